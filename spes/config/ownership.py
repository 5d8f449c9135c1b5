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
