"""Mixture-of-experts layer: softmax top-k router -> sort tokens by expert -> grouped matmul -> combine.

Shape legend: T tokens, D hidden, I expert width, E experts, K experts per token, S = T*K routed rows.
Expert weights use Hugging Face OLMoE's layout (gate_up_proj E x 2I x D, down_proj E x D x I) so export
is a rename. They are held in contiguous *chunks* of experts so that a SPES node can keep its own experts
trainable (requires_grad=True) and the others frozen (requires_grad=False, optionally bf16): frozen
chunks get no weight gradient and no optimizer state, yet activations still backpropagate through them.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Iterable, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from spes.config.schema import EXPERTS_IMPLS
from spes.errors import ConfigError


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient dense: grouped_mm's CPU backward rejects
    stride-0 (expanded) gradients such as the one `y.sum().backward()` produces."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    # grouped_mm needs 16-byte aligned strides on every operand.
    if not hasattr(F, "grouped_mm"):
        return False
    if x.is_cuda and x.dtype != torch.bfloat16:  # CUDA grouped_mm kernels are bf16-only
        return False
    align = 16 // x.element_size()
    return x.shape[-1] % align == 0 and w.shape[-1] % align == 0 and w.shape[-2] % align == 0


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def experts_impl(requested: str, x: torch.Tensor, w: torch.Tensor) -> str:
    """`requested` is ModelConfig.experts_impl: 'auto' = torch's grouped_mm where it has a kernel (CPU;
    CUDA bf16), else the Triton kernel on CUDA, else a loop over experts; anything else is used as given."""
    if requested not in EXPERTS_IMPLS:
        raise ConfigError(f"experts_impl must be one of {EXPERTS_IMPLS}, got {requested!r}")
    if requested != "auto":
        return requested
    if _grouped_mm_ok(x, w):
        return "grouped_mm"
    return "triton" if x.is_cuda and _triton_available() else "loop"


def _grouped_mm(x_SD: torch.Tensor, w_EOD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    return _ContiguousGrad.apply(F.grouped_mm(x_SD, w_EOD.transpose(-2, -1), offs=offs_E))


@functools.cache
def _grouped_mm_eager():
    """torch.compile traces grouped_mm with a meta kernel that accepts bf16 only, while the CPU kernel also
    runs fp32: a compiled block runs the fp32 call eagerly (a graph break) instead of failing. Built on first
    use: torch.compiler.disable imports dynamo and with it triton, which must not happen at our import (a
    triton imported before TRITON_INTERPRET is set cannot interpret kernels)."""
    return torch.compiler.disable(_grouped_mm)


def grouped_linear(x_SD: torch.Tensor, w_EOD: torch.Tensor, counts_E: torch.Tensor,
                   counts_list: Optional[list[int]] = None, impl: str = "auto") -> torch.Tensor:
    """Rows of x sorted by expert; rows [off_e, off_e + counts_e) go through expert e: y = x @ w_e^T."""
    if torch.is_autocast_enabled(x_SD.device.type):  # grouped_mm is not on autocast's op lists: cast here
        x_SD = x_SD.to(torch.get_autocast_dtype(x_SD.device.type))
    w_EOD = w_EOD.to(x_SD.dtype)
    impl = experts_impl(impl, x_SD, w_EOD)
    if impl == "grouped_mm":
        return (_grouped_mm if x_SD.dtype == torch.bfloat16 else _grouped_mm_eager())(x_SD, w_EOD, counts_E)
    if impl == "triton":
        from spes.model.kernels.triton_grouped import triton_grouped_linear

        return triton_grouped_linear(x_SD, w_EOD, counts_E)
    # Reference loop: one contiguous slice per expert (host sync for the counts).
    counts_list = counts_E.tolist() if counts_list is None else counts_list
    outs = [x_e @ w_EOD[e].t() for e, x_e in enumerate(torch.split(x_SD, counts_list))]
    return torch.cat(outs) if outs else x_SD.new_zeros(0, w_EOD.shape[1])


class ExpertChunk(nn.Module):
    """Experts [start, end) of one layer, all trainable or all frozen."""

    start: int
    end: int
    trainable: bool
    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter

    def __init__(self, start: int, end: int, gate_up_EID: torch.Tensor, down_EDI: torch.Tensor, trainable: bool):
        super().__init__()
        self.start, self.end, self.trainable = start, end, trainable
        self.gate_up_proj = nn.Parameter(gate_up_EID, requires_grad=trainable)
        self.down_proj = nn.Parameter(down_EDI, requires_grad=trainable)

    def forward(self, x_SD: torch.Tensor, counts_E: torch.Tensor, counts_list: Optional[list[int]] = None,
                impl: str = "auto") -> torch.Tensor:
        """SwiGLU of the rows routed to these experts. A module call, so that wrappers that act on a module's
        call (FSDP gathering its weights, hooks) see the chunk's weights used."""
        gate_up_S2I = grouped_linear(x_SD, self.gate_up_proj, counts_E, counts_list, impl)
        gate_SI, up_SI = gate_up_S2I.chunk(2, dim=-1)
        return grouped_linear(F.silu(gate_SI) * up_SI, self.down_proj, counts_E, counts_list, impl)


class Experts(nn.Module):
    """E SwiGLU experts stored as chunks of contiguous experts."""

    def __init__(self, num_experts: int, hidden: int, inter: int, std: float = 0.02, impl: str = "auto"):
        super().__init__()
        self.num_experts, self.hidden, self.inter, self.impl = num_experts, hidden, inter, impl
        gate_up = torch.randn(num_experts, 2 * inter, hidden) * std
        down = torch.randn(num_experts, hidden, inter) * std
        self.chunks = nn.ModuleList([ExpertChunk(0, num_experts, gate_up, down, True)])

    # -- ownership ------------------------------------------------------------------------------
    def set_trainable(self, owned: Iterable[int], frozen_dtype: torch.dtype = torch.float32,
                      group_of: Optional[dict[int, object]] = None) -> None:
        """Re-chunk so that `owned` experts are trainable and all others frozen (values kept). `group_of`
        (expert -> a label, e.g. its optimizer's step count) keeps experts of different labels in different
        chunks: an optimizer keeps one step count per chunk."""
        owned_set = set(owned)
        gate_up, down = self.full_weights()
        flags = [e in owned_set for e in range(self.num_experts)]
        group = [(group_of or {}).get(e) if flags[e] else None for e in range(self.num_experts)]
        chunks, start = [], 0
        for e in range(1, self.num_experts + 1):
            if e == self.num_experts or flags[e] != flags[start] or group[e] != group[start]:
                dtype = gate_up.dtype if flags[start] else frozen_dtype
                chunks.append(ExpertChunk(start, e, gate_up[start:e].clone().to(dtype),
                                          down[start:e].clone().to(dtype), flags[start]))
                start = e
        self.chunks = nn.ModuleList(chunks)

    def expert_chunks(self) -> list[ExpertChunk]:
        return cast(list[ExpertChunk], list(self.chunks))

    @torch.no_grad()
    def full_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up E x 2I x D, down E x D x I) in the trainable chunks' dtype (fp32 master)."""
        dtype = next((c.gate_up_proj.dtype for c in self.expert_chunks() if c.trainable), torch.float32)
        gate_up = torch.cat([c.gate_up_proj.detach().to(dtype) for c in self.expert_chunks()])
        down = torch.cat([c.down_proj.detach().to(dtype) for c in self.expert_chunks()])
        return gate_up, down

    @torch.no_grad()
    def load_full(self, gate_up_EID: torch.Tensor, down_EDI: torch.Tensor) -> None:
        for c in self.expert_chunks():
            c.gate_up_proj.copy_(gate_up_EID[c.start:c.end])
            c.down_proj.copy_(down_EDI[c.start:c.end])

    # -- compute --------------------------------------------------------------------------------
    def forward(self, x_SD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        if len(self.chunks) == 1:  # no host sync on this path (grouped_mm / Triton take device offsets)
            return self.expert_chunks()[0](x_SD, counts_E, impl=self.impl)
        counts = counts_E.tolist()  # host sync: chunk boundaries are needed to slice the rows
        outs, row = [], 0
        for c in self.expert_chunks():
            n = sum(counts[c.start:c.end])
            outs.append(c(x_SD[row:row + n], counts_E[c.start:c.end], counts[c.start:c.end], self.impl))
            row += n
        return torch.cat(outs)


@dataclass
class RouterOutput:
    logits_TE: torch.Tensor  # fp32
    probs_TE: torch.Tensor  # fp32 softmax
    top_idx_TK: torch.Tensor
    top_w_TK: torch.Tensor  # in the activation dtype
    counts_E: torch.Tensor  # routed rows per expert


class TopKRouter(nn.Module):
    """Softmax over all experts, then top-k (OLMoE); probabilities optionally renormalized over the k."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, std: float = 0.02):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.randn(num_experts, hidden) * std)

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        with torch.autocast(x_TD.device.type, enabled=False):  # router math in fp32, also under autocast
            logits_TE = F.linear(x_TD.float(), self.weight.float())
        probs_TE = torch.softmax(logits_TE, dim=-1)
        top_w_TK, top_idx_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w_TK = top_w_TK / top_w_TK.sum(dim=-1, keepdim=True)
        counts_E = torch.bincount(top_idx_TK.reshape(-1), minlength=self.num_experts)
        return RouterOutput(logits_TE, probs_TE, top_idx_TK, top_w_TK.to(x_TD.dtype), counts_E)


class MoE(nn.Module):
    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, norm_topk_prob: bool, std: float,
                 experts_impl: str = "auto"):
        super().__init__()
        self.gate = TopKRouter(hidden, num_experts, top_k, norm_topk_prob, std)
        self.experts = Experts(num_experts, hidden, inter, std, experts_impl)

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, RouterOutput]:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(-1, D)
        r = self.gate(x_TD)
        K = r.top_idx_TK.shape[1]
        # Stable sort of the T*K (token, slot) pairs by expert: each expert's rows become contiguous.
        order_S = torch.argsort(r.top_idx_TK.reshape(-1), stable=True)
        token_S = order_S // K
        y_SD = self.experts(x_TD[token_S], r.counts_E)
        y_SD = y_SD * r.top_w_TK.reshape(-1)[order_S].unsqueeze(-1)
        out_TD = torch.zeros_like(x_TD).index_add_(0, token_S, y_SD.to(x_TD.dtype))
        return out_TD.view(B, S, D), r
