"""Which node trains which experts.

With N nodes and E experts, node i owns experts [i*E/N, (i+1)*E/N) in every layer (SPES §3);
an explicit map may be given instead. Every expert has exactly one owner.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from spes.errors import OwnershipError


@dataclass(frozen=True)
class Ownership:
    num_experts: int
    experts_per_node: tuple[tuple[int, ...], ...]

    @classmethod
    def contiguous(cls, num_experts: int, num_nodes: int) -> "Ownership":
        if num_nodes < 1:
            raise OwnershipError(f"num_nodes must be >= 1, got {num_nodes}")
        if num_experts % num_nodes != 0:
            raise OwnershipError(
                f"{num_experts} experts cannot be split evenly over {num_nodes} nodes; "
                "give the ownership explicitly")
        k = num_experts // num_nodes
        return cls(num_experts, tuple(tuple(range(i * k, (i + 1) * k)) for i in range(num_nodes)))

    @classmethod
    def from_lists(cls, lists: list[list[int]], num_experts: int) -> "Ownership":
        check_owners({node: tuple(experts) for node, experts in enumerate(lists)}, num_experts)
        return cls(num_experts, tuple(tuple(sorted(x)) for x in lists))

    @classmethod
    def plan(cls, num_experts: int, num_nodes: int, explicit: list[list[int]] | None) -> "Ownership":
        """The initial plan of a sparse method: `explicit` lists (sync.ownership), else contiguous blocks."""
        if explicit is None:
            return cls.contiguous(num_experts, num_nodes)
        own = cls.from_lists(explicit, num_experts)
        if own.num_nodes != num_nodes:
            raise OwnershipError(f"ownership lists {own.num_nodes} nodes but sync.num_nodes is {num_nodes}")
        return own

    @classmethod
    def everyone_owns_all(cls, num_experts: int, num_nodes: int) -> "Ownership":
        """DiLoCo/FedAvg/centralized: every node trains every expert."""
        return cls(num_experts, tuple(tuple(range(num_experts)) for _ in range(num_nodes)))

    @property
    def num_nodes(self) -> int:
        return len(self.experts_per_node)

    def owned(self, node: int) -> tuple[int, ...]:
        return self.experts_per_node[node]

    def owner_of(self, expert: int) -> int:
        for node, experts in enumerate(self.experts_per_node):
            if expert in experts:
                return node
        raise OwnershipError(f"expert {expert} has no owner")


Owners = dict[int, tuple[int, ...]]
"""node id -> the experts it trains (a run's ownership in one round; node ids need not be contiguous)."""


def owners_of(own: Ownership) -> Owners:
    """The initial plan as a map: node i (0..N-1) -> its experts."""
    return {i: tuple(e) for i, e in enumerate(own.experts_per_node)}


def check_owners(owners: Owners, num_experts: int) -> None:
    """Every expert has exactly one owner, or OwnershipError naming the first that has not."""
    seen: dict[int, int] = {}
    for node in sorted(owners):
        for e in owners[node]:
            if not 0 <= e < num_experts:
                raise OwnershipError(f"ownership: node {node} lists expert {e}, outside [0, {num_experts})")
            if e in seen:
                raise OwnershipError(f"ownership: expert {e} is owned by nodes {seen[e]} and {node}")
            seen[e] = node
    missing = sorted(set(range(num_experts)) - set(seen))
    if missing:
        raise OwnershipError(f"ownership: experts {missing} have no owner")


def without_node(owners: Owners, leaver: int, caps: Optional[dict[int, int]] = None) -> tuple[Owners, dict[int, int]]:
    """The ownership once `leaver` is gone: each of its experts (lowest id first) goes to the survivor that
    owns the fewest experts then (ties: the lowest node id) among those under their cap (`caps`: node -> the
    most experts that fit its memory; absent: no cap), so counts stay balanced. Returns (new owners,
    {expert: its new owner})."""
    caps = caps or {}
    if leaver not in owners:
        raise OwnershipError(f"node {leaver} is not a member (members: {sorted(owners)})")
    rest = {n: list(e) for n, e in owners.items() if n != leaver}
    if not rest:
        raise OwnershipError(f"node {leaver} is the run's last member: its experts would have no owner")
    moved = {}
    for e in sorted(owners[leaver]):
        room = [n for n in rest if len(rest[n]) < caps.get(n, math.inf)]
        if not room:
            raise OwnershipError(f"node {leaver}'s expert {e} fits no other member (each holds as many experts as "
                                 f"its memory allows: {dict(sorted(caps.items()))})")
        to = min(room, key=lambda n: (len(rest[n]), n))
        rest[to].append(e)
        moved[e] = to
    return {n: tuple(sorted(x)) for n, x in rest.items()}, moved


def with_node(owners: Owners, joiner: int, cap: Optional[int] = None) -> tuple[Owners, dict[int, int]]:
    """The ownership once `joiner` is in: it takes one expert at a time (the donor's highest id) from the
    member that owns the most (ties: the lowest node id) while that evens the counts out, so no member keeps
    more than one expert above the joiner, and while it stays within `cap` (the most experts that fit its
    memory). Returns (new owners, {expert: its former owner})."""
    if joiner in owners:
        raise OwnershipError(f"node {joiner} is already a member (members: {sorted(owners)})")
    out = {n: list(e) for n, e in owners.items()}
    mine: list[int] = []
    taken = {}
    while out:
        donor = max(out, key=lambda n: (len(out[n]), -n))
        if len(out[donor]) <= len(mine) + 1 or (cap is not None and len(mine) >= cap):
            break
        e = max(out[donor])
        out[donor].remove(e)
        mine.append(e)
        taken[e] = donor
    out[joiner] = mine
    return {n: tuple(sorted(x)) for n, x in out.items()}, taken


def planned_changes(entries: list[str], rounds: int, num_nodes: int) -> list[tuple[int, str, int]]:
    """`orchestration.membership_plan` as (round, 'join'|'leave', node), in order: each entry is
    '<join|leave> <node> after <R>' (R a round, or 'P%' of sync.rounds, at least round 1): the change is
    applied when round R is aggregated, so a leaver's last round is R and a joiner's first is R+1. Checked
    by playing it on the initial members 0..num_nodes-1: a join of a member, a leave of a non-member or of
    the last member is an error naming the entry."""
    out = []
    members = set(range(num_nodes))
    for entry in entries:
        parts = str(entry).split()
        if len(parts) != 4 or parts[0] not in ("join", "leave") or parts[2] != "after" or not parts[1].isdigit():
            raise OwnershipError(f"orchestration.membership_plan: {entry!r} is not '<join|leave> <node> after <round "
                                 "or P%>'")
        at = parts[3]
        try:
            r = max(1, int(rounds * float(at[:-1]) / 100)) if at.endswith("%") else int(at)
        except ValueError:
            raise OwnershipError(f"orchestration.membership_plan: {entry!r}: {at!r} is not a round or a percentage") from None
        if not 1 <= r < rounds:
            raise OwnershipError(f"orchestration.membership_plan: {entry!r} falls at round {r}, outside [1, {rounds - 1}]")
        out.append((r, parts[0], int(parts[1])))
    out.sort(key=lambda c: c[0])
    for r, kind, node in out:
        if kind == "join" and node in members:
            raise OwnershipError(f"orchestration.membership_plan: node {node} joins after round {r} but is a member then")
        if kind == "leave" and node not in members:
            raise OwnershipError(f"orchestration.membership_plan: node {node} leaves after round {r} but is not a member then")
        if kind == "leave" and members == {node}:
            raise OwnershipError(f"orchestration.membership_plan: node {node} would leave after round {r} as the last member")
        members = members | {node} if kind == "join" else members - {node}
    return out
