"""Grouped GEMM for the MoE experts in Triton: rows sorted by expert, expert e owns rows [offs[e], offs[e+1]).

  y[r, :]  = x[r, :] @ w[e]^T            (forward; w is E x N x K, HF OLMoE layout: out x in)
  dx[r, :] = dy[r, :] @ w[e]             (same kernel, w read transposed through its strides)
  dw[e]    = dy[rows_e]^T @ x[rows_e]    (only for trainable chunks: frozen experts get no kernel at all)

No host sync: the tile -> expert map is computed on the device, and the grid is sized by the upper bound
cdiv(rows, BM) + E tiles. Used on CUDA where torch's grouped_mm does not apply (fp32/fp16); runs on the
CPU under TRITON_INTERPRET=1, which is how the tests check it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BM, BN, BK = 32, 32, 32


@triton.jit
def _rows_kernel(X, W, Y, OFFS, TILE_OFFS, E, N, K,
                 sxm, sxk, swe, swn, swk, sym, syn,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # expert of this row tile: the number of experts whose tiles end at or before it
    e = 0
    for i in range(0, E):
        e += (tl.load(TILE_OFFS + i + 1) <= pid_m).to(tl.int32)
    valid = e < E  # tiles past the last expert's are padding of the grid: no rows
    e = tl.minimum(e, E - 1)
    row_end = tl.where(valid, tl.load(OFFS + e + 1), 0)
    rm = tl.load(OFFS + e) + (pid_m - tl.load(TILE_OFFS + e)) * BM + tl.arange(0, BM)
    rmask = rm < row_end
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(X + rm[:, None] * sxm + rk[None, :] * sxk, mask=rmask[:, None] & (rk[None, :] < K), other=0.0)
        w = tl.load(W + e * swe + rk[:, None] * swk + rn[None, :] * swn,
                    mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(x, w, input_precision=PREC)
    tl.store(Y + rm[:, None] * sym + rn[None, :] * syn, acc.to(Y.dtype.element_ty),
             mask=rmask[:, None] & (rn[None, :] < N))


@triton.jit
def _weight_grad_kernel(DY, X, DW, OFFS, N, K, sdym, sdyn, sxm, sxk, swe, swn, swk,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    e = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.program_id(2) * BK + tl.arange(0, BK)
    start = tl.load(OFFS + e)
    end = tl.load(OFFS + e + 1)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for m0 in range(start, end, BM):
        rm = m0 + tl.arange(0, BM)
        mmask = rm < end
        dy = tl.load(DY + rm[None, :] * sdym + rn[:, None] * sdyn, mask=mmask[None, :] & (rn[:, None] < N), other=0.0)
        x = tl.load(X + rm[:, None] * sxm + rk[None, :] * sxk, mask=mmask[:, None] & (rk[None, :] < K), other=0.0)
        acc += tl.dot(dy, x, input_precision=PREC)
    tl.store(DW + e * swe + rn[:, None] * swn + rk[None, :] * swk, acc.to(DW.dtype.element_ty),
             mask=(rn[:, None] < N) & (rk[None, :] < K))


def _prec(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"  # fp32 stays fp32; 16-bit inputs ignore it


def _offsets(counts_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    zero = counts_E.new_zeros(1, dtype=torch.int32)
    offs = torch.cat([zero, torch.cumsum(counts_E, 0, dtype=torch.int32)])
    tiles = torch.div(counts_E + (BM - 1), BM, rounding_mode="floor")
    tile_offs = torch.cat([zero, torch.cumsum(tiles, 0, dtype=torch.int32)])
    return offs, tile_offs


def _rows(x_SK: torch.Tensor, w: torch.Tensor, n_out: int, w_strides: tuple[int, int, int],
          offs: torch.Tensor, tile_offs: torch.Tensor) -> torch.Tensor:
    S, K = x_SK.shape
    E = offs.numel() - 1
    y = x_SK.new_empty(S, n_out)
    if S == 0:
        return y
    grid = (triton.cdiv(S, BM) + E, triton.cdiv(n_out, BN))
    _rows_kernel[grid](x_SK, w, y, offs, tile_offs, E, n_out, K, x_SK.stride(0), x_SK.stride(1), *w_strides,
                       y.stride(0), y.stride(1), BM=BM, BN=BN, BK=BK, PREC=_prec(x_SK))
    return y


class TritonGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SK: torch.Tensor, w_ENK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        x_SK = x_SK.contiguous()
        offs, tile_offs = _offsets(counts_E)
        ctx.save_for_backward(x_SK, w_ENK, offs, tile_offs)
        return _rows(x_SK, w_ENK, w_ENK.shape[1], (w_ENK.stride(0), w_ENK.stride(1), w_ENK.stride(2)), offs,
                     tile_offs)

    @staticmethod
    def backward(ctx, dy_SN: torch.Tensor):
        x_SK, w_ENK, offs, tile_offs = ctx.saved_tensors
        dy_SN = dy_SN.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dx = dy @ w[e]: the forward kernel with w's n and k strides swapped
            dx = _rows(dy_SN, w_ENK, w_ENK.shape[2], (w_ENK.stride(0), w_ENK.stride(2), w_ENK.stride(1)), offs,
                       tile_offs)
        if ctx.needs_input_grad[1]:
            E, N, K = w_ENK.shape
            dw = torch.empty_like(w_ENK)
            grid = (E, triton.cdiv(N, BN), triton.cdiv(K, BK))
            _weight_grad_kernel[grid](dy_SN, x_SK, dw, offs, N, K, dy_SN.stride(0), dy_SN.stride(1),
                                      x_SK.stride(0), x_SK.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
                                      BM=BM, BN=BN, BK=BK, PREC=_prec(x_SK))
        return dx, dw, None


def triton_grouped_linear(x_SK: torch.Tensor, w_ENK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    return TritonGroupedLinear.apply(x_SK, w_ENK, counts_E)
