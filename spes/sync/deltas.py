"""What crosses the link at a sync, in both directions, and the arithmetic both sides must share.

Up (node i, round r): the delta of what it trained against global r-1, encoded by the codec, with the
node's error-feedback residual added first:
    shared.safetensors    tensors averaged over nodes (SPES: the non-expert ones; baselines: all)
    experts.safetensors   SPES only: the rows of the node's own experts
Down (every node, round r): the global delta bundle `rounds/<r>/delta/`:
    shared.safetensors    the encoded global delta of the averaged tensors
    experts-<j>.safetensors  merging rounds only: the encoded delta of owner j's merged experts
  and in its meta `expert_files`: per owner j whose rows changed, the rows and where their delta is: in the
  delta bundle (merging rounds), or owner j's upload itself (`source`, `sha256`: the very bytes j sent, not
  copied), which a node that is j already holds.
The committed global r is prev + decode(delta), computed by `add_decoded` / `add_decoded_rows` on the CPU,
so the aggregator and every node get the same bits (the node checks its rebuilt model's sha256 against
the committed one).
"""
from __future__ import annotations

from typing import Optional

import torch

from spes.sync.codecs import Codec
from spes.sync.method import SyncMethod

SHARED_FILE, EXPERTS_FILE = "shared.safetensors", "experts.safetensors"
"""A node's upload: the delta of the averaged tensors, and of its own experts' rows."""
MODEL_FILE, OUTER_FILE, RESIDUAL_FILE = "model.safetensors", "outer.safetensors", "residual.safetensors"
"""A global bundle: the model, the method's outer state, the aggregator's encoding residual."""
MOMENTS_FILE = "moments.safetensors"
"""sync.average_optimizer_state: a node's Adam moments of the averaged parameters (upload), their mean (global)."""
MOMENT_KINDS = ("exp_avg", "exp_avg_sq")


def averaged_moments(method: SyncMethod, optim: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Adam moments among a node's optimizer tensors (spes/train/trainer.py's names) of the parameters
    the method averages: what sync.average_optimizer_state uploads."""
    out = {}
    for key, t in optim.items():
        base, _, kind = key.rpartition("::")
        canonical = base.split("[", 1)[0]  # an expert range's tensor: its canonical name
        if kind in MOMENT_KINDS and method.is_averaged(canonical):
            out[key] = t
    return out


def experts_file(owner: int) -> str:
    return f"experts-{owner:03d}.safetensors"


def encoded_specs(codec: Codec, shapes: dict[str, tuple[int, ...]]) -> list:
    """File order of encoded tensors: by tensor name, then the codec's parts."""
    return [spec for name in sorted(shapes) for spec in codec.encoded_specs(name, shapes[name])]


def read_parts(reader, codec: Codec, name: str, shape) -> dict[str, torch.Tensor]:
    return {part: reader.read(part) for part, _, _ in codec.encoded_specs(name, shape)}


# -- the shared arithmetic -----------------------------------------------------------------------------
def add_decoded(prev: torch.Tensor, codec: Codec, name: str, parts: dict) -> torch.Tensor:
    return prev + codec.decode(name, parts, tuple(prev.shape))


def _contiguous(rows: list[int]) -> bool:
    return rows == list(range(rows[0], rows[0] + len(rows)))


def add_decoded_rows(prev: torch.Tensor, changes: list[tuple[list[int], dict]], codec: Codec,
                     name: str) -> torch.Tensor:
    """An expert tensor whose rows of each owner (rows, parts) are prev[rows] + decode(parts); rows of no
    owner in `changes` stay prev's. Rows are an owner's experts: contiguous blocks by default."""
    new = torch.empty_like(prev)
    covered = torch.zeros(prev.shape[0], dtype=torch.bool)
    for rows, parts in changes:
        dec = codec.decode(name, parts, (len(rows), *prev.shape[1:]))
        if _contiguous(rows):
            torch.add(prev[rows[0]:rows[0] + len(rows)], dec, out=new[rows[0]:rows[0] + len(rows)])
        else:
            idx = torch.tensor(rows, dtype=torch.long)
            new[idx] = prev[idx] + dec
        covered[rows] = True
    if not bool(covered.all()):
        new[~covered] = prev[~covered]
    return new


def encode_with_feedback(codec: Codec, name: str, x: torch.Tensor, residual: Optional[dict], keep: bool):
    """Encode x (+ the residual kept for it); returns (parts, new residual or None)."""
    if residual is not None and name in residual:
        x = x + residual[name]
    parts = codec.encode(name, x)
    if keep and not codec.exact:
        return parts, x - codec.decode(name, parts, tuple(x.shape))
    return parts, None


# -- node side: up ---------------------------------------------------------------------------------------
def encode_upload(method: SyncMethod, codec: Codec, prev: dict[str, torch.Tensor], trained: dict[str, torch.Tensor],
                  owned: tuple[int, ...], residual: Optional[dict], error_feedback: bool):
    """(files {fname: parts}, new residual) for a node that trained `trained` from global `prev`.
    `trained` holds full averaged tensors and, for SPES, only the owned rows of expert tensors."""
    files: dict[str, dict[str, torch.Tensor]] = {SHARED_FILE: {}}
    if method.sparse_experts:
        files[EXPERTS_FILE] = {}
    new_residual: dict[str, torch.Tensor] = {}
    rows = torch.tensor(list(owned), dtype=torch.long)
    for name in sorted(trained):
        averaged = method.is_averaged(name)
        base = prev[name] if averaged else prev[name][rows]
        parts, res = encode_with_feedback(codec, name, trained[name].float() - base, residual, error_feedback)
        files[SHARED_FILE if averaged else EXPERTS_FILE].update(parts)
        if res is not None:
            new_residual[name] = res
    return files, new_residual


# -- node side: sync.overlap (the node's own delta, folded into a later global) ------------------------------
def own_delta(method: SyncMethod, start: dict[str, torch.Tensor], trained: dict[str, torch.Tensor],
              owned: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """What the node trained in a round, exactly (fp32): `trained` (the trainer's upload: full averaged tensors,
    the owned rows of expert tensors) minus the same part of the model it started from."""
    rows = torch.tensor(list(owned), dtype=torch.long)
    return {name: trained[name].float() - (start[name] if method.is_averaged(name) else start[name][rows])
            for name in sorted(trained)}


def with_own_delta(method: SyncMethod, base: dict[str, torch.Tensor], delta: dict[str, torch.Tensor],
                   owned: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """`base` with the node's own delta added to the part it trained; every other tensor and row is base's
    exactly (others' experts take their committed values). The fold-in: global r-1 + the node's round-r
    delta is the model it goes on from."""
    rows = list(owned)
    out = dict(base)
    for name in sorted(delta):
        if method.is_averaged(name):
            out[name] = base[name] + delta[name]
        else:
            t = base[name].clone()
            t[rows] = base[name][rows] + delta[name]
            out[name] = t
    return out


# -- node side: down -------------------------------------------------------------------------------------
def apply_delta(prev: dict[str, torch.Tensor], codec: Codec, method: SyncMethod, files: dict[str, dict],
                expert_rows: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Global r from global r-1 and delta r (`files`: fname -> tensors; `expert_rows`: the rows of each
    owner's expert file, from the delta's meta)."""
    new = {}
    for name in sorted(prev):
        if method.is_averaged(name):
            new[name] = add_decoded(prev[name], codec, name, files[SHARED_FILE])
        else:
            new[name] = add_decoded_rows(prev[name], [(expert_rows[f], files[f]) for f in sorted(expert_rows)],
                                         codec, name)
    return new
