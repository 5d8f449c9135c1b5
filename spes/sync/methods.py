"""The sync methods as objects: who trains what, what is averaged, how the global model changes, when experts
merge. Everything that differs between SPES and its baselines is here, behind one interface; the rest of
the code asks the method instead of comparing its name.

- spes: each node trains the shared parameters and its own experts (contiguous blocks, or spes.ownership);
  shared tensors = prev + mean over the nodes present of their deltas (optionally token-weighted; with
  spes.shared_outer nesterov, DiLoCo's outer step on that mean); each expert = prev + its owner's delta
  (absent owners: unchanged); the expert-merging warm-up while alpha > 0.
- fedavg: every node trains everything; prev + mean(delta_i).
- centralized: fedavg on one node with num_nodes x batch_size sequences per step (the same tokens per step).
- diloco: every node trains everything; the pseudo-gradient is -mean(delta_i); an outer SGD step (Nesterov
  momentum by default: lr 0.7, momentum 0.9 as in DiLoCo) gives the new global.
Sums run in fp32 in a fixed node order, so a retried aggregation gives the same bits.
"""
from __future__ import annotations

from typing import Optional

import torch

from spes.config.ownership import Owners, Ownership, owners_of, with_node, without_node
from spes.config.schema import SpesConfig
from spes.errors import ConfigError
from spes.model.names import is_expert_param
from spes.sync.merging import merge_alpha, merge_due


def node_weights(tokens: list[int], token_weighted: bool) -> list[float]:
    if not tokens:
        raise ValueError("aggregation with no node results")
    if token_weighted:
        total = float(sum(tokens))
        if total <= 0:
            raise ValueError("token-weighted mean with zero tokens")
        return [t / total for t in tokens]
    return [1.0 / len(tokens)] * len(tokens)


def weighted_sum(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """sum_i w_i * t_i in fp32, in the given order."""
    acc = torch.mul(tensors[0].float(), weights[0])
    for t, w in zip(tensors[1:], weights[1:]):
        acc.add_(t.float(), alpha=w)
    return acc


def outer_step(mean_delta: torch.Tensor, momentum_buf: Optional[torch.Tensor], lr: float, momentum: float,
               nesterov: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """DiLoCo's outer SGD on the pseudo-gradient g = -mean_delta, with torch.optim.SGD's arithmetic
    (dampening 0): returns (change to the global model, new momentum buffer or None)."""
    g = -mean_delta
    if momentum <= 0:
        return -lr * g, None
    buf = g.clone() if momentum_buf is None else momentum_buf * momentum + g
    step = g + momentum * buf if nesterov else buf
    return -lr * step, buf


class SyncMethod:
    """FedAvg's behaviour; the other methods override what differs."""

    name = "fedavg"
    sparse_experts = False
    """Each node trains only its own experts (and uploads only their rows)."""
    keeps_outer_state = False
    """The aggregator keeps per-tensor state across rounds (DiLoCo's momentum)."""

    def __init__(self, s: SpesConfig):
        self.s = s

    @property
    def nodes(self) -> int:
        """Nodes that train."""
        return self.s.num_nodes

    @property
    def node_batch_size(self) -> int:
        """Sequences per optimizer step on each training node."""
        return self.s.batch_size

    def ownership(self, num_experts: int) -> Ownership:
        """Which node trains which experts."""
        return Ownership.everyone_owns_all(num_experts, self.nodes)

    def owned(self, node: int, num_experts: int) -> tuple[int, ...]:
        return self.ownership(num_experts).owned(node) if num_experts else ()

    def initial_owners(self, num_experts: int) -> Owners:
        """Round 1's members (0..nodes-1) and the experts each trains."""
        return owners_of(self.ownership(num_experts))

    def without_node(self, owners: Owners, leaver: int, num_experts: int,
                     caps: Optional[dict[int, int]] = None) -> tuple[Owners, dict[int, int]]:
        """(owners once `leaver` is gone, {expert: new owner} of what moved); `caps`: node -> most experts."""
        if leaver not in owners:
            return without_node(owners, leaver)  # its error
        rest = {n: e for n, e in owners.items() if n != leaver}
        if not rest:
            return without_node(owners, leaver)
        return rest, {}

    def with_node(self, owners: Owners, joiner: int, num_experts: int,
                  cap: Optional[int] = None) -> tuple[Owners, dict[int, int]]:
        """(owners once `joiner` is in, {expert: former owner} of what moved); `cap`: the most it can own."""
        if joiner in owners:
            return with_node(owners, joiner)  # its error
        return {**owners, joiner: tuple(range(num_experts))}, {}

    def is_averaged(self, name: str) -> bool:
        """Whether the new value of canonical tensor `name` is a mean over nodes (else: taken from its owner)."""
        return True

    def global_change(self, deltas: list[torch.Tensor], weights: list[float], outer_state=None):
        """(change to an averaged tensor, new outer state or None) from the nodes' decoded deltas."""
        return weighted_sum(deltas, weights), None

    def merge_alpha(self, step: int, num_experts: int) -> float:
        """The expert-merging alpha applied at sync `step` (0 = no merging this round)."""
        return 0.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class FedAvg(SyncMethod):
    pass


class Centralized(SyncMethod):
    """The num_nodes-node run it is compared with, done by one node with num_nodes x batch_size."""

    name = "centralized"

    @property
    def nodes(self) -> int:
        return 1

    @property
    def node_batch_size(self) -> int:
        return self.s.batch_size * self.s.num_nodes


class DiLoCo(SyncMethod):
    name = "diloco"

    @property
    def keeps_outer_state(self) -> bool:
        return self.s.outer_momentum > 0

    def global_change(self, deltas, weights, outer_state=None):
        return outer_step(weighted_sum(deltas, weights), outer_state, self.s.outer_lr, self.s.outer_momentum,
                          self.s.outer_nesterov)


class Spes(SyncMethod):
    name = "spes"
    sparse_experts = True

    def ownership(self, num_experts: int) -> Ownership:
        return Ownership.plan(num_experts, self.nodes, self.s.ownership)

    def without_node(self, owners, leaver, num_experts, caps=None):
        return without_node(owners, leaver, caps)

    def with_node(self, owners, joiner, num_experts, cap=None):
        return with_node(owners, joiner, cap)

    def is_averaged(self, name: str) -> bool:
        return not is_expert_param(name)

    @property
    def keeps_outer_state(self) -> bool:
        return self.s.shared_outer == "nesterov" and self.s.outer_momentum > 0

    def global_change(self, deltas, weights, outer_state=None):
        if self.s.shared_outer == "average":
            return super().global_change(deltas, weights, outer_state)
        return outer_step(weighted_sum(deltas, weights), outer_state, self.s.outer_lr, self.s.outer_momentum,
                          self.s.outer_nesterov)

    def merge_alpha(self, step: int, num_experts: int) -> float:
        m = self.s.merge
        if not (m.enabled and num_experts > 0):
            return 0.0
        alpha = merge_alpha(step, m.alpha_start, m.decay_steps)
        return alpha if merge_due(step, m.interval, alpha) else 0.0


METHODS = {cls.name: cls for cls in (Spes, FedAvg, Centralized, DiLoCo)}


def sync_method(s: SpesConfig) -> SyncMethod:
    """The method `spes.method` names, bound to the run's SPES settings."""
    try:
        return METHODS[s.method](s)
    except KeyError:
        raise ConfigError(f"spes.method must be one of {sorted(METHODS)}, got {s.method!r}") from None
