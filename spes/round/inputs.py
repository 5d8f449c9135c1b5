"""What a node's round starts from, read by its rank 0: global r-1 (rebuilt from the deltas since the global
it holds, or downloaded) and the node's state that global was built with (from its machine, or the checkpoint
on shared storage), with the round's membership.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from spes.errors import MembershipError, ProtocolError, StorageError
from spes.round.context import RoundContext
from spes.round.fetch import fetch_global
from spes.run.local_runs import node_state_root, tidy_other_runs_once
from spes.run.membership import membership_of
from spes.run.node_state import NodeState, NodeStateDir
from spes.run.records import GlobalMeta, StateRef
from spes.sync.deltas import MOMENTS_FILE, experts_file

log = logging.getLogger("spes.round.node")


@dataclass
class RoundInputs:
    """What a node needs to train round r, read by rank 0 (from storage and its own folder)."""

    prev: dict[str, torch.Tensor]
    prev_sha: str
    model_config: dict
    state: Optional[NodeState]
    ref: Optional[StateRef]
    local: NodeStateDir
    owned: tuple[int, ...]
    """The experts the node trains this round (round r's membership, in global r-1)."""
    slot: int
    """The share of the data it reads."""
    position: int
    """Its data position: its state's, or (no state: a new member) where its slot would be had it read every round."""


def read_inputs(ctx: RoundContext, r: int, node: int, from_checkpoint: bool = False) -> RoundInputs:
    """Rank 0: global r-1 (rebuilt from the deltas since the global held here, or downloaded) and the node's
    state that global was built with (from this machine, or the checkpoint on shared storage). With
    `from_checkpoint` (its machine was lost), a state that is neither here nor checkpointed is replaced by the
    node's latest checkpointed one (its optimizer state, residual and data position of then)."""
    p, store, run, layout = ctx.p, ctx.store, ctx.name, ctx.layout
    info = ctx.run.info()
    if info is None:
        raise ProtocolError(f"run {run!r} has no info on {store.url}")
    local = NodeStateDir(node_state_root(p), store.url, run, info["run_id"], node)
    tidy_other_runs_once(p, store, run, info["run_id"], local)
    prev_manifest = ctx.run.global_manifest(r - 1)
    prev_meta = GlobalMeta.from_json(prev_manifest["meta"], f"{store.url}/{layout.global_dir(r - 1)}")
    membership = membership_of(prev_meta, ctx.method)
    if node not in membership.owners:
        raise MembershipError(f"node {node} is not a member of run {run!r} in round {r} (members "
                              f"{membership.members}); to take part again: python -m spes.members join --node {node}")
    ref = prev_meta.node_states.get(node)
    if from_checkpoint and ref is not None and not ref.checkpoint and not local.has_state(ref):
        k, ref_k = ctx.run.last_checkpointed_state(node, ref.round)
        log.warning("node %d round %d: its state after round %d is on a lost machine; continuing from its "
                    "checkpoint of round %d (optimizer state, residual and data position of then; the model is "
                    "global %d)", node, r, ref.round, k, r - 1)
        ref = ref_k
    local.discard_after(ref.round if ref else 0)
    state = local.load_state(ref, store, layout.state_dir(ref.round, node)) if ref else None
    if state is not None and p.sync.average_optimizer_state and MOMENTS_FILE in prev_manifest["files"]:
        # every node continues from the mean of the nodes' moments of the averaged parameters
        mean = store.read_bundle(layout.global_dir(r - 1), [MOMENTS_FILE], prev_manifest).files[MOMENTS_FILE]
        state.optim.update({k: v for k, v in mean.items() if k in state.optim})
    # its own experts' rows in the delta are the bytes it uploaded last: no need to download them back
    own_cached = {experts_file(node): (state.experts_sha256, state.experts_upload)} \
        if state is not None and state.experts_upload else None
    held = local.base()
    prev, prev_sha = fetch_global(store, layout, r - 1, prev_manifest, ctx.codec, ctx.method, held,
                                  local.load_base, own_cached)
    if held != (r - 1, prev_sha) and local.save_base(r - 1, prev) != prev_sha:
        raise StorageError(f"node {node}: global {r - 1} as held here does not hash to the committed {prev_sha[:12]}")
    owned = tuple(membership.owners[node])
    if state is not None and state.owned is not None and state.owned != owned:
        gave, took = sorted(set(state.owned) - set(owned)), sorted(set(owned) - set(state.owned))
        log.warning("node %d round %d: trains experts %s%s%s", node, r, list(owned),
                    f"; gave away {gave}" if gave else "",
                    f"; took over {took}, which start with a fresh optimizer state" if took else "")
    position = state.data_position if state is not None else (r - 1) * p.sync.every_steps
    return RoundInputs(prev, prev_sha, prev_meta.model_config, state, ref, local, owned, membership.slots[node],
                       position)
