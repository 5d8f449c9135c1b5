"""Aggregation arithmetic, one tensor at a time, on the nodes' decoded deltas (theta_i - global r-1).

- spes: shared (non-expert) tensors = prev + mean over the nodes present of their deltas (optionally
  token-weighted); each expert = prev + its owner's delta (absent owners: unchanged). Expert rows are
  handled by spes/round/aggregator.py with the codec, since they are taken, not averaged.
- diloco: every node trains everything; the pseudo-gradient is -mean(delta_i); an outer SGD step (Nesterov
  momentum by default: lr 0.7, momentum 0.9 as in DiLoCo) gives the new global.
- fedavg / centralized: prev + mean(delta_i) (one node: its own model).
Sums run in fp32 in a fixed node order, so a retried aggregation gives the same bits.
"""
from __future__ import annotations

from typing import Optional

import torch


def node_weights(tokens: list[int], token_weighted: bool) -> list[float]:
    if not tokens:
        raise ValueError("aggregation with no node results")
    if token_weighted:
        total = float(sum(tokens))
        if total <= 0:
            raise ValueError("token-weighted mean with zero tokens")
        return [t / total for t in tokens]
    return [1.0 / len(tokens)] * len(tokens)


def weighted_sum(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """sum_i w_i * t_i in fp32, in the given order."""
    acc = torch.mul(tensors[0].float(), weights[0])
    for t, w in zip(tensors[1:], weights[1:]):
        acc.add_(t.float(), alpha=w)
    return acc


def outer_step(mean_delta: torch.Tensor, momentum_buf: Optional[torch.Tensor], lr: float, momentum: float,
               nesterov: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """DiLoCo's outer SGD on the pseudo-gradient g = -mean_delta, with torch.optim.SGD's arithmetic
    (dampening 0): returns (change to the global model, new momentum buffer or None)."""
    g = -mean_delta
    if momentum <= 0:
        return -lr * g, None
    buf = g.clone() if momentum_buf is None else momentum_buf * momentum + g
    step = g + momentum * buf if nesterov else buf
    return -lr * step, buf


def global_change(method: str, deltas: list[torch.Tensor], weights: list[float], momentum_buf=None, *,
                  outer_lr: float = 0.7, outer_momentum: float = 0.9, outer_nesterov: bool = True):
    """(change to an averaged tensor, new outer momentum or None) for the method."""
    mean = weighted_sum(deltas, weights)
    if method == "diloco":
        return outer_step(mean, momentum_buf, outer_lr, outer_momentum, outer_nesterov)
    if method in ("spes", "fedavg", "centralized"):
        return mean, None
    raise ValueError(f"unknown aggregation method {method!r}")
