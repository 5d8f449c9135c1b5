"""Router auxiliary losses (per layer; the model combines them over layers) and the SPES decayed load-balance factor."""
from __future__ import annotations

from typing import Optional

import torch

from spes.errors import ConfigError


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


def load_balance(counts_LE: list[list[int]]) -> list[float]:
    """Per layer: max over experts of the routed rows / their mean (1.0 when every expert gets the same; nan
    for a layer that routed nothing). What the round table and the run's TensorBoard curves show."""
    out = []
    for layer in counts_LE:
        mean = sum(layer) / len(layer) if layer else 0.0
        out.append(max(layer) / mean if mean > 0 else float("nan"))
    return out


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


class _ChunkedLinearCE(torch.autograd.Function):
    """The LM head and the loss together, chunk by chunk over tokens: a chunk's logits exist only while it is
    processed, in the forward and again (recomputed) in the backward, so the loss never holds N x V logits.
    Returns (mean cross-entropy over the labelled tokens, mean logsumexp(logits)^2 over all tokens)."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, chunk: int, ignore_index: int):
        N = h_ND.shape[0]
        lse_N = torch.empty(N, dtype=torch.float32, device=h_ND.device)
        ce_sum = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        w = w_VD.to(h_ND.dtype)
        for s in range(0, N, chunk):
            logits_CV = (h_ND[s:s + chunk] @ w.t()).float()
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            y_C = labels_N[s:s + chunk]
            valid_C = y_C != ignore_index
            target_C = logits_CV.gather(1, torch.where(valid_C, y_C, 0)[:, None]).squeeze(1)
            ce_sum += torch.where(valid_C, lse_C - target_C, 0.0).sum()
            lse_N[s:s + chunk] = lse_C
        n_valid = (labels_N != ignore_index).sum().clamp_min(1)
        ctx.save_for_backward(h_ND, w_VD, labels_N, lse_N, n_valid)
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        return ce_sum / n_valid, lse_N.square().mean()

    @staticmethod
    def backward(ctx, g_ce, g_z):
        h_ND, w_VD, labels_N, lse_N, n_valid = ctx.saved_tensors
        N, chunk = h_ND.shape[0], ctx.chunk
        w = w_VD.to(h_ND.dtype)
        grad_h = torch.empty_like(h_ND)
        grad_w = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device)
        scale_ce, scale_z = g_ce.float() / n_valid, g_z.float() * 2.0 / N
        for s in range(0, N, chunk):
            h_CD = h_ND[s:s + chunk]
            logits_CV = (h_CD @ w.t()).float()
            lse_C, y_C = lse_N[s:s + chunk], labels_N[s:s + chunk]
            valid_C = y_C != ctx.ignore_index
            p_CV = torch.exp(logits_CV - lse_C[:, None])
            # d ce/d logits = (softmax - onehot) / n_valid on labelled tokens; d z/d logits = 2 lse softmax / N
            d_CV = p_CV * (scale_ce * valid_C[:, None] + scale_z * lse_C[:, None])
            rows = torch.arange(len(y_C), device=y_C.device)[valid_C]
            d_CV[rows, y_C[valid_C]] -= scale_ce
            grad_h[s:s + chunk] = (d_CV.to(h_CD.dtype) @ w).to(grad_h.dtype)
            grad_w += d_CV.t() @ h_CD.float()
        return grad_h, grad_w.to(w_VD.dtype), None, None, None


def chunked_linear_cross_entropy(h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor, chunk: int,
                                 ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy of h @ w^T against labels, LM-head z-loss mean(logsumexp(h @ w^T)^2)), equal to the plain
    path (F.cross_entropy on the full logits) within fp32 rounding, with peak memory for the loss of a
    chunk x V block instead of N x V (spes/train/plan.py counts it)."""
    if chunk < 1:
        raise ConfigError(f"loss chunk must be >= 1 tokens, got {chunk}")
    return _ChunkedLinearCE.apply(h_ND, w_VD, labels_N, chunk, ignore_index)
