"""Who trains what before round 1, as the run's sync method plans it: the one question the memory and link
planners (spes/train/plan.py, capacity.py, link_plan.py) ask the method, asked in one place."""
from __future__ import annotations

from dataclasses import dataclass

from spes.config.schema import Params
from spes.sync.method import SyncMethod
from spes.sync.methods import sync_method


@dataclass(frozen=True)
class PlannedNodes:
    """The run's nodes as its sync method plans them for round 1: the planners' one question to the method."""

    method: SyncMethod
    owned: tuple[tuple[int, ...], ...]
    """The experts each node trains."""

    @property
    def count(self) -> int:
        return len(self.owned)

    @property
    def batch_size(self) -> int:
        """Sequences per node per step."""
        return self.method.node_batch_size


def planned_nodes(p: Params) -> PlannedNodes:
    method = sync_method(p)
    return PlannedNodes(method, tuple(method.owned(i, p.model.num_experts) for i in range(method.nodes)))
