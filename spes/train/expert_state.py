"""Adam state of a node's experts that survives a change of ownership (spes/run/membership.py).

A node's trainable experts sit in chunks of contiguous experts, one optimizer parameter (and one Adam step
count) per chunk and tensor. The stored state names an expert chunk by what it holds, not by its position
among the chunks: `model.layers.3.mlp.experts.gate_up_proj[4:6]::exp_avg` is experts 4 and 5. So when the
node's experts change, the state of each expert it keeps is found whatever the new chunks are, the state of
an expert it gave away is dropped, and an expert it took over starts fresh. Experts whose step counts differ
are kept in different chunks (MoE.set_trainable's `group_of`), so each chunk's single step count is exact.
States written before this naming (`...experts.chunks.K.gate_up_proj`) load when the chunks are the same.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from spes.errors import OptimizerStateError
from spes.sync.deltas import MOMENT_KINDS

_RANGED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj))\[(\d+):(\d+)\]$")
_CHUNK = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.chunks\.\d+\.(gate_up_proj|down_proj)$")


def ranged_name(canonical: str, start: int, end: int) -> str:
    """The stored name of experts [start, end) of canonical expert tensor `canonical`."""
    return f"{canonical}[{start}:{end}]"


def parse_ranged(name: str) -> Optional[tuple[str, int, int]]:
    m = _RANGED.match(name)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def canonical_of_chunk(param_name: str) -> Optional[str]:
    """`model.layers.3.mlp.experts.gate_up_proj` for `model.layers.3.mlp.experts.chunks.1.gate_up_proj`."""
    m = _CHUNK.match(param_name)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def expert_steps(tensors: dict[str, torch.Tensor]) -> dict[int, float]:
    """expert -> the Adam step count of its stored state (experts without one: absent)."""
    out: dict[int, float] = {}
    for key, t in tensors.items():
        base, _, kind = key.rpartition("::")
        parsed = parse_ranged(base) if kind == "step" else None
        if parsed is not None:
            for e in range(parsed[1], parsed[2]):
                out[e] = float(t.reshape(-1)[0].item())
    return out


def _entries(tensors: dict[str, torch.Tensor]) -> dict[str, list[tuple[int, int, str]]]:
    out: dict[str, list[tuple[int, int, str]]] = {}
    for key in tensors:
        base, _, kind = key.rpartition("::")
        parsed = parse_ranged(base) if kind == "step" else None
        if parsed is not None:
            out.setdefault(parsed[0], []).append((parsed[1], parsed[2], base))
    return out


def chunk_state(tensors: dict[str, torch.Tensor], canonical: str, start: int,
                end: int) -> Optional[dict[str, torch.Tensor]]:
    """Adam's state of experts [start, end) of `canonical` from stored ranged entries: {'step', 'exp_avg',
    'exp_avg_sq'}, or None when none of these experts has a stored state (they start fresh). A chunk whose
    experts are partly stored, or stored with different step counts, is an error (the chunks are built so
    that this cannot happen)."""
    entries = _entries(tensors).get(canonical, [])
    pieces, steps, missing = [], set(), []
    for e in range(start, end):
        hit = next(((a, b, base) for a, b, base in entries if a <= e < b), None)
        if hit is None:
            missing.append(e)
            continue
        a, _, base = hit
        steps.add(float(tensors[f"{base}::step"].reshape(-1)[0].item()))
        pieces.append((base, e - a))
    if not pieces:
        return None
    if missing or len(steps) > 1:
        raise OptimizerStateError(f"optimizer state of {canonical}[{start}:{end}]: experts {missing} have none"
                         if missing else f"optimizer state of {canonical}[{start}:{end}]: step counts {sorted(steps)}")
    out = {"step": torch.tensor([steps.pop()], dtype=torch.float64)}
    for kind in MOMENT_KINDS:
        out[kind] = torch.stack([tensors[f"{base}::{kind}"][row] for base, row in pieces])
    return out


def remap_rows(t: torch.Tensor, old: tuple[int, ...], new: tuple[int, ...]) -> torch.Tensor:
    """Rows of `t` (one per expert of `old`, in order) for the experts of `new`: kept experts keep their row,
    new ones get zeros (an encoding residual starts empty)."""
    out = t.new_zeros((len(new), *t.shape[1:]))
    where = {e: i for i, e in enumerate(old)}
    for j, e in enumerate(new):
        if e in where:
            out[j] = t[where[e]]
    return out
