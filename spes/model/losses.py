"""Router auxiliary losses (per layer; the model combines them over layers) and the SPES decayed load-balance factor."""
from __future__ import annotations

from typing import Optional

import torch


def load_balance_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int,
                      expert_weight_E: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Switch-Transformer load balance: E * sum_e f_e * P_e.

    f_e = fraction of routed rows sent to e (sums to 1), P_e = mean router probability of e.
    `expert_weight_E` rescales f_e per expert (the decayed factor for a node's own experts).
    A balanced router gives exactly 1.0.
    """
    T, E = probs_TE.shape
    f_E = counts_E.to(probs_TE.dtype) / (T * top_k)
    if expert_weight_E is not None:
        f_E = f_E * expert_weight_E
    return E * torch.sum(f_E * probs_TE.mean(dim=0))


def grouped_load_balance_loss(probs_TE: torch.Tensor, top_idx_TK: torch.Tensor, groups: int, top_k: int,
                              expert_weight_E: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The load-balance loss of each of `groups` equal, consecutive groups of tokens, averaged: what a step
    computes when its batch goes through in `groups` micro-batches (each forward balances its own tokens,
    as megablocks does per forward call), so accumulation and a single pass give the same loss."""
    T, E = probs_TE.shape
    P_GE = probs_TE.view(groups, T // groups, E).mean(dim=1)
    idx_GR = top_idx_TK.reshape(groups, -1)
    counts_GE = torch.zeros(groups, E, dtype=probs_TE.dtype, device=probs_TE.device)
    counts_GE.scatter_add_(1, idx_GR, torch.ones_like(idx_GR, dtype=probs_TE.dtype))
    f_GE = counts_GE / (T // groups * top_k)
    if expert_weight_E is not None:
        f_GE = f_GE * expert_weight_E
    return E * (f_GE * P_GE).sum(dim=1).mean()


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss: mean over tokens of logsumexp(logits)^2; keeps router logits small."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def decayed_lb_factor(step: int, total_steps: int, start: float = 0.7, end: float = 1.0,
                      ramp_fraction: float = 0.2) -> float:
    """Own-expert load-balance factor: linear start -> end over the first `ramp_fraction` of training."""
    ramp = max(1.0, ramp_fraction * total_steps)
    return start + (end - start) * min(1.0, step / ramp)
