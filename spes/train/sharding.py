"""A node's model sharded over its ranks with FSDP2 (`train.node_parallel: fsdp`).

Each transformer block is one FSDP unit and the root (embeddings, final norm, LM head) another: a block's
weights are gathered for its forward and backward and resharded after, so a rank holds 1/G of the weights,
gradients and AdamW moments plus one gathered block at a time. Frozen experts are sharded like the rest
(in `train.frozen_dtype`) and gathered for the forward; they never get a gradient or optimizer state. With
bf16 autocast the units compute in bf16 (fp32 master weights; gradients reduced in fp32).

Rank 0 alone holds full tensors: it gives each rank its shard of what it read (the global model, the
node's optimizer state) and collects full tensors from the shards for what it writes, one tensor at a
time, so no rank ever holds a whole model it does not need. Every rank must make the same calls in the
same order: they are collectives.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from spes.model.moe import MoE
from spes.model.names import expert_tensor
from spes.model.transformer import CausalLM, check_canonical_state_dict


def shard_model(model: CausalLM, compute_dtype: Optional[torch.dtype]) -> None:
    """FSDP2 over the default process group: one unit per block, one for the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def gather(t: torch.Tensor, lead: bool) -> Optional[torch.Tensor]:
    """The full tensor (a collective for a shard) as a CPU copy on the lead rank, None on the others."""
    full = t.full_tensor() if is_sharded(t) else t
    return full.detach().to("cpu", copy=True) if lead else None


def scatter(full: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A sharded tensor laid out as `like` (a DTensor) holding the lead rank's `full` (ignored elsewhere)."""
    from torch.distributed.tensor import distribute_tensor

    if full is None:  # the shape the scatter expects; its values are not read
        full = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    else:
        full = full.to(device=like.device, dtype=like.dtype).contiguous()
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=0)


def canonical_sources(model: CausalLM) -> Iterator[tuple[str, torch.nn.Parameter, str, Optional[slice]]]:
    """(parameter name, parameter, canonical tensor it comes from, rows of it) for every parameter: a chunk
    of experts is rows [start, end) of its layer's stacked expert tensor, anything else its own name."""
    chunk_of: dict[int, tuple[str, slice]] = {}
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, MoE):
            for c in layer.mlp.experts.chunks:
                for attr in ("gate_up_proj", "down_proj"):
                    chunk_of[id(getattr(c, attr))] = (expert_tensor(i, attr), slice(c.start, c.end))
    for name, p in model.named_parameters():
        src, rows = chunk_of.get(id(p), (name, None))
        yield name, p, src, rows


@torch.no_grad()
def load_canonical_sharded(model: CausalLM, sd: Optional[dict[str, torch.Tensor]], lead: bool) -> None:
    """Every rank's shards of the lead rank's canonical state dict `sd` (None on the other ranks)."""
    if lead:
        check_canonical_state_dict(model.cfg, sd)
    for _, p, src, rows in canonical_sources(model):
        full = (sd[src] if rows is None else sd[src][rows]) if lead else None
        p.to_local().copy_(scatter(full, p).to_local())
