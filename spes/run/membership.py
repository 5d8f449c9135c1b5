"""Membership as round state: nodes leave, are evicted and join between rounds, without a restart.

Committed global r records who trains what in round r+1 (GlobalMeta.membership: the members, the experts
each owns, the data slot each reads, the rounds each missed in a row). The aggregator of round r derives it
from global r-1's, in this order:

  1. leave requests  (`python -m spes.members leave`): the node goes; its experts go to the survivors
  2. evictions       a member that missed orchestration.evict_after_rounds rounds in a row goes the same way
  3. join requests   (`python -m spes.members join`): a new node id takes experts from the most loaded members

The sync method says how experts move (SPES: balanced counts; the baselines: every member trains them all).
Requests are small files under runs/<run>/membership/. Before committing global r the aggregator stamps each
request it applies with r, so a retried round, or one recomputed by a resume from before it, applies it at
the same round: a resume across a membership change equals the uninterrupted run.

What a node does with a change (spes/train/expert_state.py): experts it takes over start from their committed
values with a fresh Adam state; it keeps its Adam state for the shared parameters and the experts it keeps.
A joiner starts everything fresh, at its data slot's position for the round.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Optional

from spes.errors import MembershipError, OwnershipError, RecordError
from spes.run.layout import RunLayout
from spes.run.records import GlobalMeta, Membership, Record
from spes.run.run import Run
from spes.storage.store import Store
from spes.sync.method import SyncMethod

log = logging.getLogger("spes.run.membership")

KINDS = RunLayout.REQUEST_KINDS
MAX_NODE_ID = 99_999


@dataclass
class Request(Record):
    kind: str
    node: int
    at_round: Optional[int] = None
    """The round whose global applied it (stamped by the aggregator before it commits that global)."""
    refused: Optional[str] = None
    """Why it could not be applied at `at_round` (e.g. the last member leaving); it is not tried again."""
    requested: str = ""
    max_experts: Optional[int] = None
    """A joiner's cap: the most experts per layer that fit its memory (`--gpu-mem`, by the planner)."""


def initial_membership(method: SyncMethod, num_experts: int) -> Membership:
    """Round 1's: nodes 0..N-1 with the params' plan (sync.ownership, or contiguous blocks), node i reading
    data slot i."""
    owners = method.initial_owners(num_experts)
    return Membership({n: list(e) for n, e in owners.items()}, {n: n for n in owners}, {})


def membership_of(meta: GlobalMeta, method: SyncMethod) -> Membership:
    """Who trains what in the round after `meta`'s global."""
    if meta.membership is not None:
        return meta.membership
    return initial_membership(method, meta.model_config.get("num_experts", 0))


def read_requests(store: Store, layout: RunLayout) -> list[Request]:
    """Every request of the run (one listing), by file name; a file that is not a request is an error that
    names it (nothing is applied until it is fixed or removed)."""
    out = []
    for name in store.list_names(layout.membership_dir):
        rel = f"{layout.membership_dir}/{name}"
        where = f"{store.url}/{rel}"
        try:
            req = Request.from_json(json.loads(store.read_bytes(rel)), where)
        except (ValueError, UnicodeDecodeError) as e:
            raise RecordError(f"{where}: not a membership request ({e}); remove it") from None
        if req.kind not in KINDS or rel != layout.request_file(req.kind, req.node):
            raise RecordError(f"{where}: not a membership request (kind {req.kind!r}, node {req.node}); remove it")
        out.append(req)
    return out


def _write(store: Store, layout: RunLayout, req: Request, exclusive: bool) -> None:
    data = json.dumps(req.to_json(), sort_keys=True).encode()
    rel = layout.request_file(req.kind, req.node)
    if exclusive:
        store.create_exclusive(rel, data)
    else:
        store.write_bytes(rel, data)


def latest_membership(store: Store, run: str, method: SyncMethod) -> tuple[int, Membership]:
    """(latest committed round r, who trains what in round r+1)."""
    handle = Run(store, run)
    r = handle.latest_round()
    if r is None:
        raise MembershipError(f"run {run!r} has no committed round on {store.url}: start it first")
    return r, membership_of(handle.global_meta(r), method)


def request(store: Store, run: str, method: SyncMethod, kind: str, node: int,
            max_experts: Optional[int] = None, min_nodes: Optional[int] = None) -> Request:
    """Ask for `node` to join or leave run `run` at its next round boundary, after checking it against the
    latest committed membership: a join of an id in use, a leave of a node that is not a member or of the
    last one, a leave that would leave fewer members than the quorum `min_nodes` (orchestration.min_nodes:
    a quorum is never lowered by a leave), a second request of the same kind for the same node, are refused
    (nothing written)."""
    layout = RunLayout(run)
    if kind not in KINDS:
        raise MembershipError(f"a membership request is one of {KINDS}, got {kind!r}")
    if not (isinstance(node, int) and 0 <= node <= MAX_NODE_ID):
        raise MembershipError(f"node ids are integers in [0, {MAX_NODE_ID}], got {node!r}")
    r, mem = latest_membership(store, run, method)
    known = {(q.kind, q.node): q for q in read_requests(store, layout)}
    members = set(mem.members) - {n for (k, n), q in known.items() if k == "leave" and q.at_round is None}
    if kind == "join" and node in mem.owners:
        raise MembershipError(f"node {node} is already a member of run {run!r} (members after round {r}: "
                              f"{mem.members}); choose another id")
    if kind == "leave" and node not in mem.owners:
        raise MembershipError(f"node {node} is not a member of run {run!r} (members after round {r}: {mem.members})")
    if kind == "leave" and members == {node}:
        raise MembershipError(f"node {node} is the last member of run {run!r}: its experts would have no owner")
    if kind == "leave" and min_nodes is not None and len(members - {node}) < min_nodes:
        raise MembershipError(f"node {node} leaving run {run!r} would leave {len(members - {node})} members, below "
                              f"orchestration.min_nodes={min_nodes}: every later round would miss its quorum "
                              "(lower orchestration.min_nodes first)")
    old = known.get((kind, node))
    if old is not None:
        if old.at_round is None:
            raise MembershipError(f"node {node}: a {kind} request of run {run!r} is already pending")
        store.remove_file(layout.request_file(kind, node))  # applied (or refused) long ago: a new one replaces it
    req = Request(kind, node, requested=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  max_experts=max_experts if kind == "join" else None)
    try:
        _write(store, layout, req, exclusive=True)
    except FileExistsError:
        raise MembershipError(f"node {node}: a {kind} request of run {run!r} is already pending") from None
    log.info("run %s: node %d asked to %s after round %d's global", run, node, kind, r + 1)
    return req


@dataclass
class Change:
    """The membership of round r+1, what changed (for people), and the requests to stamp before committing."""

    membership: Membership
    changes: list[str]
    stamped: list[Request]
    departed: list[int]


def _moves(moved: dict[int, int], arrow: str) -> str:
    return ", ".join(f"{e}{arrow}{n}" for e, n in sorted(moved.items())) or "none"


def next_membership(prev: Membership, method: SyncMethod, num_experts: int, r: int, contributors: list[int],
                    requests: list[Request], evict_after: int) -> Change:
    """Round r+1's membership from round r's (`prev`), the nodes that contributed to round r, the run's
    requests and the eviction threshold (0 = never evict); see the module docstring."""
    owners = {n: tuple(e) for n, e in prev.owners.items()}
    slots, caps = dict(prev.slots), dict(prev.caps)
    missed = {n: 0 if n in contributors else prev.missed.get(n, 0) + 1 for n in owners}
    changes, stamped, departed = [], [], []
    due = [q for q in requests if q.refused is None and q.at_round in (None, r)]

    def leave(node: int, why: str) -> None:
        nonlocal owners
        owners, moved = method.without_node(owners, node, num_experts, caps)
        for d in (slots, missed, caps):
            d.pop(node, None)
        departed.append(node)
        changes.append(f"node {node} {why}; its experts went to (expert->node) {_moves(moved, '->')}")

    def refuse(q: Request, why: str) -> None:
        stamped.append(Request(q.kind, q.node, r, why, q.requested, q.max_experts))
        changes.append(f"{q.kind} of node {q.node} refused: {why}")

    for q in sorted((q for q in due if q.kind == "leave"), key=lambda q: q.node):
        try:
            leave(q.node, "left (asked to)")
        except OwnershipError as e:
            refuse(q, str(e))
            continue
        stamped.append(Request(q.kind, q.node, r, None, q.requested, q.max_experts))
    if evict_after > 0:
        for n in sorted(n for n, k in missed.items() if k >= evict_after):
            try:
                leave(n, f"evicted (missed {missed[n]} rounds in a row)")
            except OwnershipError as e:  # it is the last member: keep waiting for it
                changes.append(f"node {n} not evicted: {e}")
    for q in sorted((q for q in due if q.kind == "join"), key=lambda q: q.node):
        try:
            owners, taken = method.with_node(owners, q.node, num_experts, q.max_experts)
        except OwnershipError as e:
            refuse(q, str(e))
            continue
        slots[q.node] = min(set(range(len(slots) + 1)) - set(slots.values()))
        missed[q.node] = 0
        if q.max_experts is not None:
            caps[q.node] = q.max_experts
        stamped.append(Request(q.kind, q.node, r, None, q.requested, q.max_experts))
        changes.append(f"node {q.node} joined (data slot {slots[q.node]}); it took (expert<-node) "
                       f"{_moves(taken, '<-')}")
    return Change(Membership({n: list(e) for n, e in sorted(owners.items())}, slots, missed, caps), changes,
                  stamped, departed)


def stamp(store: Store, layout: RunLayout, requests: list[Request]) -> None:
    """Record on each request the round that applies it (before that round's global is committed)."""
    for q in requests:
        _write(store, layout, q, exclusive=False)


def request_planned(store: Store, run: str, method: SyncMethod, plan: list[tuple[int, str, int]], r: int) -> None:
    """Ask, as round r starts, for the changes `orchestration.membership_plan` schedules after round r, once: a
    request already there (pending, or stamped with r by an earlier try or a recomputation of this round) is
    left as it is. One that can no longer be (the node was evicted meanwhile) is skipped with a warning."""
    due = [(kind, node) for at, kind, node in plan if at == r]
    if not due:
        return
    layout = RunLayout(run)
    have = {(q.kind, q.node): q for q in read_requests(store, layout)}
    for kind, node in due:
        q = have.get((kind, node))
        if q is not None and q.at_round in (None, r):
            continue
        try:
            request(store, run, method, kind, node)
        except MembershipError as e:
            log.warning("run %s: the planned %s of node %d after round %d is skipped: %s", run, kind, node, r, e)
