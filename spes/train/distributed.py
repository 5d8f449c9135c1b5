"""The ranks of one node (torch.distributed, when a node runs as a torchrun job; spes/train/trainer.py wraps the
model in DDP). Rank 0 alone reads and writes shared storage; it hands what it read to the other ranks
with these broadcasts. Without an initialized process group there is one rank and they are no-ops."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shards_node(parallel: str) -> bool:
    """Whether this node's ranks shard its model: train.node_parallel fsdp over more than one rank."""
    return parallel == "fsdp" and rank_and_size()[1] > 1


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (small, picklable things between our own ranks only)."""
    if rank_and_size()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _wire_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def broadcast_tensors(tensors: Optional[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Rank 0's CPU tensors on every rank (on the CPU), one broadcast per tensor."""
    if rank_and_size()[1] == 1:
        return tensors or {}
    lead = rank_and_size()[0] == 0
    held = tensors or {}
    specs = broadcast_object({k: (tuple(t.shape), t.dtype) for k, t in held.items()} if lead else None)
    dev, out = _wire_device(), {}
    for name in sorted(specs):
        shape, dtype = specs[name]
        t = held[name].to(dev).contiguous() if lead else torch.empty(shape, dtype=dtype, device=dev)
        dist.broadcast(t, src=0)
        out[name] = t.cpu()
    return out


def node_totals(ce: torch.Tensor, counts: Optional[torch.Tensor], tokens: int):
    """A step over the node's ranks: the mean loss, all ranks' routed rows and tokens (every rank calls it)."""
    world = dist.get_world_size()
    ce = ce.clone()
    dist.all_reduce(ce)
    tok = torch.tensor([tokens], device=ce.device)
    dist.all_reduce(tok)
    if counts is not None:
        counts = counts.clone()
        dist.all_reduce(counts)
    return ce / world, counts, int(tok.item())


def node_mean(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The mean over the node's ranks of a per-rank value (every rank calls it, or none: t is None on all)."""
    if t is None:
        return None
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()
