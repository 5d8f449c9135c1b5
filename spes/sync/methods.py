"""The sync methods, and the registry `sync.method` selects from. Everything that differs between SPES and
its baselines is here (or in a module of its own, for a method with its own outer optimizer), behind the
interface of spes/sync/method.py; the rest of the code asks the method instead of comparing its name.

- spes: each node trains the shared parameters and its own experts (contiguous blocks, or sync.ownership);
  shared tensors = prev + mean over the nodes present of their deltas (optionally token-weighted; with
  outer.shared nesterov, DiLoCo's outer step on that mean); each expert = prev + its owner's delta
  (absent owners: unchanged); the expert-merging warm-up while alpha > 0.
- fedavg: every node trains everything; prev + mean(delta_i).
- centralized: fedavg on one node with num_nodes x batch_size sequences per step (the same tokens per step).
- diloco: every node trains everything; the pseudo-gradient is -mean(delta_i); an outer SGD step (Nesterov
  momentum by default: lr 0.7, momentum 0.9 as in DiLoCo) gives the new global.
- fedadam (spes/sync/fedadam.py): every node trains everything; a server Adam step on the pseudo-gradient.
Sums run in fp32 in a fixed node order, so a retried aggregation gives the same bits.

Adding a method: a class implementing SyncMethod (a module of its own if it brings an outer optimizer), its
entry in METHODS, and its name in spes/config/schema.py's METHODS (a test keeps the two lists equal).
"""
from __future__ import annotations

from spes.config.ownership import Ownership, with_node, without_node
from spes.config.schema import OuterConfig, Params
from spes.errors import ConfigError
from spes.model.names import is_expert_param
from spes.sync.fedadam import FedAdam
from spes.sync.merging import ExpertMerging
from spes.sync.method import FullModelMethod, SyncMethod
from spes.sync.outer import Average, OuterOptimizer, OuterSGD


class FedAvg(FullModelMethod):
    name = "fedavg"

    def outer_optimizer(self) -> OuterOptimizer:
        return Average()


class Centralized(FedAvg):
    """The num_nodes-node run it is compared with, done by one node with num_nodes x batch_size."""

    name = "centralized"

    @property
    def nodes(self) -> int:
        return 1

    @property
    def node_batch_size(self) -> int:
        return self.batch_size * self.sync.num_nodes


def _outer_sgd(o: OuterConfig) -> OuterSGD:
    return OuterSGD(o.lr, o.momentum, o.nesterov)


class DiLoCo(FullModelMethod):
    name = "diloco"

    def outer_optimizer(self) -> OuterOptimizer:
        return _outer_sgd(self.outer_settings)


class Spes(SyncMethod):
    name = "spes"
    sparse_experts = True

    def __init__(self, p: Params):
        super().__init__(p)
        self.merging = ExpertMerging(p.merge)

    def ownership(self, num_experts: int) -> Ownership:
        return Ownership.plan(num_experts, self.nodes, self.sync.ownership)

    def without_node(self, owners, leaver, num_experts, caps=None):
        return without_node(owners, leaver, caps)

    def with_node(self, owners, joiner, num_experts, cap=None):
        return with_node(owners, joiner, cap)

    def is_averaged(self, name: str) -> bool:
        return not is_expert_param(name)

    def outer_optimizer(self) -> OuterOptimizer:
        return Average() if self.outer_settings.shared == "average" else _outer_sgd(self.outer_settings)

    @property
    def has_expert_outer_step(self) -> bool:  # type: ignore[override]
        return self.outer_settings.experts == "nesterov"

    def expert_state_specs(self, name, shape):
        return _outer_sgd(self.outer_settings).state_specs(name, shape) if self.has_expert_outer_step else []

    def expert_change(self, name, delta, rows, state):
        if not self.has_expert_outer_step:
            return None, {}
        return _outer_sgd(self.outer_settings).step_rows(name, delta, rows, state)

    def merge_alpha(self, step: int, num_experts: int) -> float:
        return self.merging.alpha(step, num_experts)

    def merge(self, layer, alpha):
        return self.merging.merge(layer, alpha)


METHODS: dict[str, type[SyncMethod]] = {cls.name: cls for cls in (Spes, FedAvg, Centralized, DiLoCo, FedAdam)}


def sync_method(p: Params) -> SyncMethod:
    """The method `sync.method` names, bound to the run's settings."""
    try:
        return METHODS[p.sync.method](p)
    except KeyError:
        raise ConfigError(f"sync.method must be one of {sorted(METHODS)}, got {p.sync.method!r}") from None
