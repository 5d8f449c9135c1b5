"""Nodes of different sizes: how many experts per layer each can own within its memory, and a plan that
balances them (`python -m spes.plan --nodes 24GiB,48GiB,80GiB`; a joiner's cap, `spes.members join --gpu-mem`).
Memory per node comes from the planner (spes/train/plan.py)."""
from __future__ import annotations

import json
from typing import Optional

from spes.config.schema import Params
from spes.errors import ConfigError
from spes.train.plan import DTYPE_BYTES, gib, on_nodes, plan_node


def plan_owning(p: Params, experts: int, ranks: int = 1) -> dict:
    """plan_node of a SPES node that owns `experts` experts of every layer (the rest frozen)."""
    e = p.model.num_experts
    owning = on_nodes(p, "spes", 1) if experts >= e else \
        on_nodes(p, "spes", 2, [list(range(experts)), list(range(experts, e))])
    return plan_node(owning, 0, ranks)


def max_experts_fitting(p: Params, memory: int, ranks: int = 1, who: str = "the node",
                        owning: Optional[dict] = None) -> int:
    """The most experts per layer a SPES node with `memory` per GPU can own (the others frozen), or ConfigError
    when not even one fits (naming what its frozen experts alone take)."""
    owning = owning or {k: plan_owning(p, k, ranks) for k in range(1, p.model.num_experts + 1)}
    fits = [k for k, m in owning.items() if m["peak_bytes"] <= memory]
    if not fits:
        one = owning[1]
        raise ConfigError(f"{who} ({gib(memory)}): owning even one expert per layer needs "
                          f"{gib(one['peak_bytes'])} per GPU, its frozen experts alone "
                          f"{gib(one['frozen_params'] * DTYPE_BYTES[p.train.frozen_dtype])}")
    return max(fits)


def capacity_plan(p: Params, memories: list[int], ranks: int = 1) -> dict:
    """Experts per layer for nodes of different memory: every node fits its memory and the largest count (the
    slowest node, by the time model below) is as small as it can be.

    Time model (a model, not a measurement): every SPES node runs the forward pass and the input-gradient
    backward of the whole active model on the same number of tokens, the same work on every node; what grows
    with ownership is the weight gradients and the AdamW update of its own experts. So with GPUs of equal
    speed the slowest node is the one owning the most experts, and balancing counts under the memory caps
    minimizes it (water-filling: each node up to a common level, capped by what fits it).
    Raises ConfigError naming the node that cannot hold even one expert, or the shortfall."""
    e = p.model.num_experts
    if e < 1:
        raise ConfigError("a capacity plan needs an MoE model (model.num_experts >= 1)")
    if not memories:
        raise ConfigError("--nodes: name at least one node's memory, e.g. 24GiB,48GiB")
    owning = {k: plan_owning(p, k, ranks) for k in range(1, e + 1)}  # the same for every node
    caps = [max_experts_fitting(p, mem, ranks, f"node {i}", owning) for i, mem in enumerate(memories)]
    if sum(caps) < e or len(memories) > e:
        raise ConfigError(f"the nodes hold at most {min(sum(caps), e)} of the {e} experts per layer between them "
                          f"({', '.join(f'node {i}: {c}' for i, c in enumerate(caps))}); every expert needs an "
                          "owner and every node at least one expert")
    level = next(t for t in range(1, e + 1) if sum(min(c, t) for c in caps) >= e)
    counts = [min(c, level) for c in caps]
    for i in reversed(range(len(counts))):  # give back the excess, one each from the last nodes at the level
        if sum(counts) > e and counts[i] == level and counts[i] > 1:
            counts[i] -= 1
    starts = [sum(counts[:i]) for i in range(len(counts))]
    ownership = [list(range(a, a + c)) for a, c in zip(starts, counts)]
    plan = on_nodes(p, "spes", len(counts), ownership)
    peaks = [plan_node(plan, i, ranks)["peak_bytes"] for i in range(len(counts))]
    return {"experts_per_node": counts, "max_experts_per_node": caps, "ownership": ownership,
            "peak_bytes": peaks, "memory_bytes": list(memories),
            "overrides": [f"sync.num_nodes={len(counts)}", "sync.ownership=" + json.dumps(ownership).replace(" ", "")]}
