"""Which node trains which experts.

With N nodes and E experts, node i owns experts [i*E/N, (i+1)*E/N) in every layer (SPES §3);
an explicit map may be given instead. Every expert has exactly one owner.
"""
from __future__ import annotations

from dataclasses import dataclass

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
        seen: dict[int, int] = {}
        for node, experts in enumerate(lists):
            for e in experts:
                if not 0 <= e < num_experts:
                    raise OwnershipError(f"ownership: node {node} lists expert {e}, outside [0, {num_experts})")
                if e in seen:
                    raise OwnershipError(f"ownership: expert {e} is owned by nodes {seen[e]} and {node}")
                seen[e] = node
        missing = sorted(set(range(num_experts)) - set(seen))
        if missing:
            raise OwnershipError(f"ownership: experts {missing} have no owner")
        return cls(num_experts, tuple(tuple(sorted(x)) for x in lists))

    @classmethod
    def plan(cls, num_experts: int, num_nodes: int, explicit: list[list[int]] | None) -> "Ownership":
        """The initial plan of a sparse method: `explicit` lists (spes.ownership), else contiguous blocks."""
        if explicit is None:
            return cls.contiguous(num_experts, num_nodes)
        own = cls.from_lists(explicit, num_experts)
        if own.num_nodes != num_nodes:
            raise OwnershipError(f"ownership lists {own.num_nodes} nodes but spes.num_nodes is {num_nodes}")
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


def without_node(owners: Owners, leaver: int) -> tuple[Owners, dict[int, int]]:
    """The ownership once `leaver` is gone: each of its experts (lowest id first) goes to the survivor that
    owns the fewest experts then (ties: the lowest node id), so counts stay balanced. Returns (new owners,
    {expert: its new owner})."""
    if leaver not in owners:
        raise OwnershipError(f"node {leaver} is not a member (members: {sorted(owners)})")
    rest = {n: list(e) for n, e in owners.items() if n != leaver}
    if not rest:
        raise OwnershipError(f"node {leaver} is the run's last member: its experts would have no owner")
    moved = {}
    for e in sorted(owners[leaver]):
        to = min(rest, key=lambda n: (len(rest[n]), n))
        rest[to].append(e)
        moved[e] = to
    return {n: tuple(sorted(x)) for n, x in rest.items()}, moved


def with_node(owners: Owners, joiner: int) -> tuple[Owners, dict[int, int]]:
    """The ownership once `joiner` is in: it takes one expert at a time (the donor's highest id) from the
    member that owns the most (ties: the lowest node id) while that evens the counts out, so no member keeps
    more than one expert above the joiner. Returns (new owners, {expert: its former owner})."""
    if joiner in owners:
        raise OwnershipError(f"node {joiner} is already a member (members: {sorted(owners)})")
    out = {n: list(e) for n, e in owners.items()}
    mine: list[int] = []
    taken = {}
    while out:
        donor = max(out, key=lambda n: (len(out[n]), -n))
        if len(out[donor]) <= len(mine) + 1:
            break
        e = max(out[donor])
        out[donor].remove(e)
        mine.append(e)
        taken[e] = donor
    out[joiner] = mine
    return {n: tuple(sorted(x)) for n, x in out.items()}, taken
