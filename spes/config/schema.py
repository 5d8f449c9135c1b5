"""The configuration schema: one dataclass per section of `params.yaml`, a docstring per field, and the
checks beside the fields they check.

Each section lives in its own module (model, training, stages, runtime; the choices of every enumerated
setting in choices) and checks its own fields in `validate()`; `Params` checks what involves two sections
(a sequence length against model.max_seq_len, the ownership plan against the model's experts, the quorum
against sync.num_nodes) and runs every check when it is built, so a `Params` is valid however it was made:
from the YAML (`spes/config/loader.py`), in code, in a test, from a node's JSON. Code that changes a field
afterwards calls `validate()` again. The defaults are the embedded default's values (params.yaml sets them
explicitly too, as documentation; tests/spes/config/test_loader.py keeps the two equal), so a unit test that
builds `Params()` and `dvc repro` compute the same thing. Nothing here touches the filesystem.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterator

from spes.config.choices import (  # noqa: F401  (re-exported: the schema is where the choices are read)
    ACTIVATION_CHECKPOINTING,
    AUTOCAST_DTYPES,
    CODECS,
    CORPUS_FORMATS,
    DATA_ORDERS,
    DEVICE_PATTERN,
    EXECUTORS,
    EXPERTS_IMPLS,
    LOSS_IMPLS,
    METHODS,
    NODE_PARALLEL,
    QK_NORMS,
    SAFE_NAME,
    SCHEDULES,
    STORAGE_PROTOCOLS,
    check_name,
    check_seq,
    need,
)
from spes.config.model import TRAINING_FIELDS, ModelConfig, model_for_training  # noqa: F401
from spes.config.ownership import Ownership, planned_changes
from spes.config.runtime import CheckpointConfig, OrchestrationConfig, StorageConfig
from spes.config.stages import CompareConfig, DataConfig, DenseConfig, EvalConfig, InitConfig, TokenizeConfig
from spes.config.training import MergeConfig, OptimConfig, OuterConfig, SyncConfig, TrainConfig  # noqa: F401
from spes.errors import ConfigError, OwnershipError

SEEDS = ("train.seed", "tokenize.seed", "init.seed", "dense.seed")
"""Every seed must be >= 0 (numpy refuses negative seeds)."""


@dataclass
class Params:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    init: InitConfig = field(default_factory=InitConfig)
    dense: DenseConfig = field(default_factory=DenseConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    orchestration: OrchestrationConfig = field(default_factory=OrchestrationConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    artifacts_dir: str = "artifacts"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "Params":
        """Every section's checks, then those across sections; raises ConfigError naming the key."""
        self._check_numbers()
        self.storage.validate()
        self.model.validate()
        self.sync.validate()
        self.train.validate()
        self.outer.validate()
        self.merge.validate()
        self._check_training()
        self.dense.validate()
        self.eval.validate()
        for key, value in (("dense.seq_len", self.dense.seq_len), ("eval.seq_len", self.eval.seq_len)):
            check_seq(value, key, self.model.max_seq_len)
        self.init.validate()
        self.tokenize.validate()
        self.data.validate()
        self.orchestration.validate()
        self._check_quorum()
        self._check_overlap()
        self.checkpoint.validate()
        self.compare.validate()
        return self

    def _check_numbers(self) -> None:
        """Every number finite (YAML reads 1e309 as inf), every seed >= 0."""
        for key, value in _leaves(self, ""):
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{key} must be a finite number, got {value}")
        for key in SEEDS:
            section, leaf = key.split(".")
            value = getattr(getattr(self, section), leaf)
            need(value >= 0, f"{key} must be >= 0, got {value}")

    def _check_training(self) -> None:
        """The method against the model (experts to own) and the outer step; the node's training against the
        model (sequence length, donors to merge) and the node's ranks."""
        m, s, t, ranks = self.model, self.sync, self.train, self.orchestration.gpus_per_node
        if s.method == "spes":
            need(m.is_moe, "sync.method=spes needs an MoE model (model.num_experts > 0)")
            try:  # the same function the nodes use to find their experts
                Ownership.plan(m.num_experts, s.num_nodes, s.ownership)
            except OwnershipError as e:
                key = "sync.ownership" if s.ownership is not None else "model.num_experts / sync.num_nodes"
                raise ConfigError(f"{key}: {e}") from None
        need(self.outer.experts == "owner" or s.method == "spes",
             f"outer.experts: nesterov is for sync.method spes (the other methods average every tensor), got "
             f"method {s.method!r}")
        need(self.outer.shared == "average" or s.method == "spes",
             f"outer.shared: nesterov is for sync.method spes (diloco always takes its outer step; "
             f"{s.method} averages), got method {s.method!r}")
        need(ranks < 1 or t.batch_size % ranks == 0,
             f"train.batch_size ({t.batch_size}) must be a multiple of orchestration.gpus_per_node ({ranks})")
        need(t.node_parallel != "fsdp" or ranks > 1,
             "train.node_parallel is fsdp, which shards a node over its ranks, but orchestration.gpus_per_node is 1 "
             "(use ddp, or 2 or more GPUs per node)")
        mb, per_rank = t.micro_batch_size, t.batch_size // max(ranks, 1)
        need(mb is None or (mb >= 1 and per_rank % mb == 0),
             f"train.micro_batch_size ({mb}) must divide the per-rank batch (train.batch_size / "
             f"orchestration.gpus_per_node = {per_rank})")
        check_seq(t.seq_len, "train.seq_len", m.max_seq_len)
        if m.is_moe and self.merge.enabled:
            need(self.merge.top_k < m.num_experts,
                 f"merge.top_k ({self.merge.top_k}) must be < model.num_experts ({m.num_experts})")

    def _check_overlap(self) -> None:
        """A node that starts round r from global r-2 plus its own delta needs global r-2 on storage."""
        k = self.storage.keep_rounds
        need(self.sync.overlap == "none" or k is None or k >= 2,
             f"sync.overlap one_round starts each round from global r-2 (plus the node's own delta): "
             f"storage.keep_rounds must be >= 2 or null, got {k}")

    def _check_quorum(self) -> None:
        o, s = self.orchestration, self.sync
        mn = o.min_nodes
        need(mn is None or 1 <= mn <= s.num_nodes, f"orchestration.min_nodes ({mn}) must be in [1, sync.num_nodes={s.num_nodes}]")
        planned_changes(o.membership_plan, s.rounds, s.num_nodes)  # raises OwnershipError (a ConfigError) naming the entry
        need(o.evict_after_rounds == 0 or (mn is not None and mn < s.num_nodes),
             "orchestration.evict_after_rounds needs orchestration.min_nodes below sync.num_nodes: with a quorum of "
             "every member, a round a node misses fails before the node can be evicted")


def check_against_model(p: Params, recorded: dict, where: str) -> None:
    """The settings against the model a run actually trains (the architecture recorded with its global, which
    may differ from `p.model`: an initial model made by another preset): merging donors, experts to own,
    sequence length. One line naming both, before any node trains, instead of a failure at aggregation."""
    actual = model_for_training(recorded, p.model)
    if actual == p.model:
        return
    try:
        dataclasses.replace(p, model=actual).validate()
    except ConfigError as e:
        raise ConfigError(f"the settings do not fit the model this run trains ({where}: {actual.num_experts} experts, "
                          f"{actual.num_layers} layers, max_seq_len {actual.max_seq_len}; params.yaml's model has "
                          f"{p.model.num_experts}, {p.model.num_layers}, {p.model.max_seq_len}): {e}") from None


def _leaves(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every setting below a section, lists and dicts walked into."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _leaves(getattr(obj, f.name), f"{prefix}{f.name}.")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), obj
