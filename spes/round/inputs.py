"""What a node's round starts from, read by its rank 0: global r-1 (rebuilt from the deltas since the global
it holds, or downloaded) and the node's state that global was built with (from its machine, or the checkpoint
on shared storage), with the round's membership.

With sync.overlap one_round the model the round trains from is not global r-1 but the node's own model after
round r-1: global r-2 plus its exact delta of round r-1 (kept in its state), which it held before global r-1
existed. A node that did not count in global r-1 (it missed the round) or whose experts changed starts from
global r-1 instead. Either way the start is a function of what is committed, so a resume is bitwise.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from spes.errors import IntegrityError, MembershipError, NodeStateError, NotCommitted, ProtocolError, StorageError
from spes.round.context import RoundContext
from spes.round.fetch import Chain, fetch_global
from spes.run.layout import MODEL_FILE
from spes.run.local_runs import open_node_state, tidy_other_runs_once
from spes.run.membership import membership_of
from spes.run.node_state import NodeState, NodeStateDir
from spes.run.records import GlobalMeta, StateRef
from spes.sync.deltas import MOMENTS_FILE, experts_file, with_own_delta

log = logging.getLogger("spes.round.node")


@dataclass
class HeldGlobal:
    """A committed global this process holds in memory (spes/round/lookahead.py fetched it ahead)."""

    sha256: str
    tensors: dict[str, torch.Tensor]
    mark: Optional[str] = None
    """Its manifest's COMMIT marker: the manifest is taken again only while the marker still names it."""
    manifest: Optional[dict] = None


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
    start: dict[str, torch.Tensor]
    """The model the round trains from and takes its delta against: `prev`, or with sync.overlap the node's own
    model after round r-1 (see the module docstring)."""


class HeldBase:
    """The global model this node holds on its machine, loaded at most once. A copy that fails its sha256
    (a flipped byte on the node's disk) is dropped with one warning naming the file, and the caller reads the
    committed global from storage instead, so a damaged local copy heals rather than stopping every rerun."""

    def __init__(self, local: NodeStateDir):
        self.local, self.mark = local, local.base()
        self._tensors: Optional[dict] = None

    def load(self) -> dict:
        if self._tensors is None:
            try:
                self._tensors = self.local.load_base()
            except IntegrityError as e:
                log.warning("node %d: its local copy of the global is damaged (%s); dropped, the committed global "
                            "is read from storage instead", self.local.node, e)
                self.local.drop_base()
                self.mark = None
                raise
        return self._tensors


def read_inputs(ctx: RoundContext, r: int, node: int, from_checkpoint: bool = False,
                known: Optional[dict[int, HeldGlobal]] = None) -> RoundInputs:
    """Rank 0: global r-1 (rebuilt from the deltas since the global held here, or downloaded) and the node's
    state that global was built with (from this machine, or the checkpoint on shared storage). With
    `from_checkpoint` (its machine was lost), a state that is neither here nor checkpointed is replaced by the
    node's latest checkpointed one (its optimizer state, residual and data position of then). `known`:
    round -> the globals this process holds in memory (spes/round/lookahead.py), used while committed."""
    known = known or {}
    p, store, run, layout = ctx.p, ctx.store, ctx.name, ctx.layout
    info = ctx.run.info()
    if info is None:
        raise ProtocolError(f"run {run!r} has no info on {store.url}")
    local = open_node_state(p, store, run, info["run_id"], node)
    tidy_other_runs_once(p, store, run, info["run_id"], local)
    held_prev = known.get(r - 1)
    if held_prev is not None and held_prev.mark is not None and held_prev.manifest is not None:
        prev_manifest = store.read_manifest(layout.global_dir(r - 1), (held_prev.mark, held_prev.manifest))
    else:
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
    held = HeldBase(local)  # the chain to global r-1 starts from it, an overlapped start too
    want = prev_manifest["files"][MODEL_FILE]["sha256"]
    if held_prev is not None and held_prev.sha256 == want:
        prev, prev_sha = held_prev.tensors, want
    else:
        prev, prev_sha = fetch_global(ctx, r - 1, prev_manifest, Chain(held.mark, held.load, own_cached))
    owned = tuple(membership.owners[node])
    if state is not None and state.owned is not None and state.owned != owned:
        gave, took = sorted(set(state.owned) - set(owned)), sorted(set(owned) - set(state.owned))
        log.warning("node %d round %d: trains experts %s%s%s", node, r, list(owned),
                    f"; gave away {gave}" if gave else "",
                    f"; took over {took}, which start with a fresh optimizer state" if took else "")
    position = state.data_position if state is not None else (r - 1) * p.sync.every_steps
    start = _start_model(ctx, r, node, state, owned, AtHand(prev, held, known))
    # kept here after the start is built: an overlapped start may read the global held before it
    if held.mark != (r - 1, prev_sha) and local.save_base(r - 1, prev) != prev_sha:
        raise StorageError(f"node {node}: global {r - 1} as held here does not hash to the committed {prev_sha[:12]}")
    return RoundInputs(prev, prev_sha, prev_meta.model_config, state, ref, local, owned, membership.slots[node],
                       position, start)


@dataclass
class AtHand:
    """The globals a node has at hand for round r: global r-1 as read, the one kept on its machine, and those
    this process holds in memory (round -> global)."""

    prev: dict
    held: HeldBase
    known: dict[int, HeldGlobal]


def _start_model(ctx: RoundContext, r: int, node: int, state: Optional[NodeState], owned: tuple[int, ...],
                 at_hand: AtHand) -> dict:
    """The model round r trains from: global r-1, or with sync.overlap the node's own model after round r-1
    (the global its delta of round r-1 was taken against, plus that delta)."""
    prev, held, known = at_hand.prev, at_hand.held, at_hand.known
    if ctx.p.sync.overlap == "none" or state is None or state.sent is None or state.sent_base is None:
        return prev
    if state.round != r - 1 or (state.owned is not None and state.owned != owned):
        log.info("node %d round %d: starts from global %d (its last delta is of round %d%s)", node, r, r - 1,
                 state.round, ", for other experts" if state.round == r - 1 else "")
        return prev
    q, sha = state.sent_base
    base = None
    if q in known and known[q].sha256 == sha:
        base = known[q].tensors
    elif held.mark == (q, sha):  # (None once a damaged copy was dropped)
        try:
            base = held.load()
        except IntegrityError:  # the damaged copy is dropped (HeldBase); storage has the committed one
            base = None
    if base is None:  # not held here (another machine, a retry after the held global moved on): from storage
        where = f"{ctx.store.url}/{ctx.layout.global_dir(q)}"
        try:
            manifest = ctx.run.global_manifest(q)
            base, got = fetch_global(ctx, q, manifest)
        except (NotCommitted, IntegrityError) as e:
            raise NodeStateError(f"node {node} round {r}: sync.overlap starts it from global {q} plus its own delta "
                                 f"of round {r - 1}, and global {q} cannot be read from {where} ({e}); resume from "
                                 "an earlier round (checkpoint rounds keep the global before them)") from None
        if got != sha:
            raise NodeStateError(f"node {node} round {r}: its delta of round {r - 1} was taken against global {q} "
                                 f"{sha[:12]}, but {where} holds {got[:12]}")
    return with_own_delta(ctx.method, base, state.sent, owned)
