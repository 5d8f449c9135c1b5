"""Aggregation of node results into the next global model.

- spes: shared (non-expert) parameters = mean over the nodes present (optionally token-weighted);
  each expert = its owner's copy; experts of absent owners keep their previous global values.
- diloco: every node trains everything; pseudo-gradient delta_i = theta_prev - theta_i, averaged, then an
  outer SGD step (Nesterov momentum by default: lr 0.7, momentum 0.9 as in DiLoCo).
- fedavg / centralized: plain mean of the nodes' full models (one node: its model).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from spes.model import is_expert_param


@dataclass
class NodeResult:
    node: int
    tensors: dict[str, torch.Tensor]
    """Trained tensors: full shared params; expert params hold only `experts` rows, in that order."""
    experts: tuple[int, ...]
    tokens: int = 1


@dataclass
class OuterState:
    """DiLoCo outer-optimizer momentum, one buffer per parameter."""

    momentum: dict[str, torch.Tensor] = field(default_factory=dict)


def _weights(results: list[NodeResult], token_weighted: bool) -> list[float]:
    if token_weighted:
        total = float(sum(r.tokens for r in results))
        if total <= 0:
            raise ValueError("token-weighted mean with zero tokens")
        return [r.tokens / total for r in results]
    return [1.0 / len(results)] * len(results)


def _mean(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    acc = torch.zeros_like(tensors[0], dtype=torch.float64)
    for t, w in zip(tensors, weights):
        acc += t.double() * w
    return acc.to(tensors[0].dtype)


def aggregate_spes(prev: dict[str, torch.Tensor], results: list[NodeResult],
                   token_weighted: bool = False) -> dict[str, torch.Tensor]:
    if not results:
        raise ValueError("aggregate_spes: no node results")
    weights = _weights(results, token_weighted)
    new: dict[str, torch.Tensor] = {}
    for name, old in prev.items():
        if is_expert_param(name):
            t = old.clone()
            for r in results:
                if r.experts:
                    t[list(r.experts)] = r.tensors[name].to(t.dtype)
            new[name] = t
        else:
            new[name] = _mean([r.tensors[name] for r in results], weights)
    return new


def pseudo_gradient(prev: dict[str, torch.Tensor], results: list[NodeResult],
                    token_weighted: bool = False) -> dict[str, torch.Tensor]:
    weights = _weights(results, token_weighted)
    return {n: _mean([prev[n] - r.tensors[n] for r in results], weights) for n in prev}


def aggregate_diloco(prev: dict[str, torch.Tensor], results: list[NodeResult], state: OuterState,
                     lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True,
                     token_weighted: bool = False) -> dict[str, torch.Tensor]:
    """Outer SGD on the averaged pseudo-gradient, same arithmetic as torch.optim.SGD(dampening=0)."""
    if not results:
        raise ValueError("aggregate_diloco: no node results")
    delta = pseudo_gradient(prev, results, token_weighted)
    new = {}
    for n, g in delta.items():
        if momentum > 0:
            buf = state.momentum.get(n)
            buf = g.clone() if buf is None else buf * momentum + g
            state.momentum[n] = buf
            g = g + momentum * buf if nesterov else buf
        new[n] = prev[n] - lr * g
    return new


def aggregate_mean(prev: dict[str, torch.Tensor], results: list[NodeResult],
                   token_weighted: bool = False) -> dict[str, torch.Tensor]:
    if not results:
        raise ValueError("aggregate_mean: no node results")
    weights = _weights(results, token_weighted)
    return {n: _mean([r.tensors[n] for r in results], weights) for n in prev}


def aggregate(method: str, prev: dict[str, torch.Tensor], results: list[NodeResult],
              outer: Optional[OuterState] = None, *, token_weighted: bool = False,
              outer_lr: float = 0.7, outer_momentum: float = 0.9, outer_nesterov: bool = True):
    if method == "spes":
        return aggregate_spes(prev, results, token_weighted)
    if method == "diloco":
        return aggregate_diloco(prev, results, outer if outer is not None else OuterState(),
                                outer_lr, outer_momentum, outer_nesterov, token_weighted)
    if method in ("fedavg", "centralized"):
        return aggregate_mean(prev, results, token_weighted)
    raise ValueError(f"unknown aggregation method {method!r}")
