"""The interface every sync method implements: who trains what, which tensors are averaged, how their mean
delta becomes the global's change (an outer optimizer that owns its per-tensor state), and whether a round
merges experts (a hook the aggregator calls on one layer's expert tensors at a time); and on the nodes, hooks
their local steps run at chosen steps (`node_hooks`, `LocalStepHook`).

The aggregator and the nodes ask the method; none of them compares a method's name or knows the layout of
its state. The methods themselves are in spes/sync/methods.py (and one module each for those that bring
their own outer optimizer, e.g. spes/sync/fedadam.py); the registry that `sync.method` selects from is
spes/sync/methods.py's METHODS.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Optional

import torch

from spes.config.ownership import Owners, Ownership, owners_of, with_node, without_node
from spes.config.schema import Params
from spes.errors import AggregationError
from spes.sync.outer import OuterOptimizer, Spec


def node_weights(tokens: list[int], token_weighted: bool) -> list[float]:
    if not tokens:
        raise AggregationError("aggregation with no node results")
    if token_weighted:
        total = float(sum(tokens))
        if total <= 0:
            raise AggregationError("token-weighted mean with zero tokens")
        return [t / total for t in tokens]
    return [1.0 / len(tokens)] * len(tokens)


def weighted_sum(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """sum_i w_i * t_i in fp32, in the given order (a retried aggregation gives the same bits)."""
    acc = torch.mul(tensors[0].float(), weights[0])
    for t, w in zip(tensors[1:], weights[1:]):
        acc.add_(t.float(), alpha=w)
    return acc


class SyncMethod(ABC):
    """A way of combining node rounds into the global model, bound to the run's settings: `sync` (the nodes
    and who owns what), `outer` (its outer step), `merge` and the nodes' batch size."""

    name: ClassVar[str]
    """Its `sync.method` value (the registry's key)."""
    sparse_experts: ClassVar[bool] = False
    """Each node trains only its own experts (and uploads only their rows)."""

    def __init__(self, p: Params):
        self.sync, self.outer_settings, self.merge_settings = p.sync, p.outer, p.merge
        self.batch_size = p.train.batch_size
        self.outer = self.outer_optimizer()

    # -- who trains what ---------------------------------------------------------------------------------
    @property
    def nodes(self) -> int:
        """Nodes that train."""
        return self.sync.num_nodes

    @property
    def node_batch_size(self) -> int:
        """Sequences per optimizer step on each training node."""
        return self.batch_size

    @abstractmethod
    def ownership(self, num_experts: int) -> Ownership:
        """The initial plan: which node trains which experts."""

    def owned(self, node: int, num_experts: int) -> tuple[int, ...]:
        return self.ownership(num_experts).owned(node) if num_experts else ()

    def initial_owners(self, num_experts: int) -> Owners:
        """Round 1's members (0..nodes-1) and the experts each trains."""
        return owners_of(self.ownership(num_experts))

    @abstractmethod
    def without_node(self, owners: Owners, leaver: int, num_experts: int,
                     caps: Optional[dict[int, int]] = None) -> tuple[Owners, dict[int, int]]:
        """(owners once `leaver` is gone, {expert: new owner} of what moved); `caps`: node -> most experts."""

    @abstractmethod
    def with_node(self, owners: Owners, joiner: int, num_experts: int,
                  cap: Optional[int] = None) -> tuple[Owners, dict[int, int]]:
        """(owners once `joiner` is in, {expert: former owner} of what moved); `cap`: the most it can own."""

    @abstractmethod
    def is_averaged(self, name: str) -> bool:
        """Whether the new value of canonical tensor `name` is a mean over nodes (else: taken from its owner)."""

    # -- how the global changes ------------------------------------------------------------------------
    @abstractmethod
    def outer_optimizer(self) -> OuterOptimizer:
        """What turns the nodes' mean delta of an averaged tensor into the global's change."""

    def outer_state_specs(self, name: str, shape: tuple[int, ...]) -> list[Spec]:
        """The state the method keeps across rounds for averaged tensor `name` (stored beside the global)."""
        return self.outer.state_specs(name, shape)

    def global_change(self, name: str, deltas: list[torch.Tensor], weights: list[float],
                      state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(change to averaged tensor `name`, its new state) from the nodes' decoded deltas (in node order)
        and the state `outer_state_specs` declared, as kept since the last round ({} at first)."""
        return self.outer.step(name, weighted_sum(deltas, weights), state)

    has_expert_outer_step: bool = False
    """Whether experts take an outer step of the method's (`expert_change`) rather than their owners' deltas."""

    def expert_state_specs(self, name: str, shape: tuple[int, ...]) -> list[Spec]:
        """The state kept across rounds for expert tensor `name` (E x ...): none when experts take their
        owners' deltas as they are."""
        return []

    def expert_change(self, name: str, delta: torch.Tensor, rows: torch.Tensor,
                      state: dict[str, torch.Tensor]) -> tuple[Optional[torch.Tensor], dict[str, torch.Tensor]]:
        """(change to expert tensor `name`, its new state) from its owners' deltas (`delta`, E x ..., the rows
        `rows` present this round); None: the owners' deltas as they are (no rewrite of their rows)."""
        return None, {}

    # -- the merging hook ------------------------------------------------------------------------------
    def merge_alpha(self, step: int, num_experts: int) -> float:
        """The expert-merging alpha applied at sync `step` (0 = no merging this round)."""
        return 0.0

    def merge(self, layer: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
        """One MoE layer's expert tensors (canonical name -> E x ...) after merging with `alpha`."""
        raise AggregationError(f"sync method {self.name!r} does not merge experts")

    # -- the node-side hook ----------------------------------------------------------------------------
    def node_hooks(self, r: int, node: int) -> list["LocalStepHook"]:
        """What the method does on the node itself during round r, beyond training: hooks the node's local
        steps run after the steps they name (none for the methods so far)."""
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class LocalStepHook(ABC):
    """A sync method's part in a node's local steps: run after the steps it names, on the node's live trained
    parameters (name -> parameter, under no_grad), so that a method changing local training (fold the global
    in mid-round, correct each step with control variates) is one class and `SyncMethod.node_hooks`.
    Deterministic by construction: it runs at fixed steps, never at an arrival time."""

    @abstractmethod
    def wants(self, step: int) -> bool:
        """Whether it runs after local step `step` of the round (0-based)."""

    @abstractmethod
    def __call__(self, step: int, params: dict[str, torch.Tensor]) -> None:
        """Change `params` in place (its rank's part of them on a sharded node)."""


class FullModelMethod(SyncMethod):
    """The baselines' shape: every node trains every parameter, and every tensor is averaged."""

    def ownership(self, num_experts: int) -> Ownership:
        return Ownership.everyone_owns_all(num_experts, self.nodes)

    def without_node(self, owners, leaver, num_experts, caps=None):
        rest = {n: e for n, e in owners.items() if n != leaver}
        if leaver not in owners or not rest:
            return without_node(owners, leaver)  # its error
        return rest, {}

    def with_node(self, owners, joiner, num_experts, cap=None):
        if joiner in owners:
            return with_node(owners, joiner)  # its error
        return {**owners, joiner: tuple(range(num_experts))}, {}

    def is_averaged(self, name: str) -> bool:
        return True
