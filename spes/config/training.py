"""The sections of training, one per concern: `sync` (the method, its nodes, the rounds, and what crosses the
link), `train` (each node's local training and its optimizer), `outer` (how the nodes' mean delta becomes the
global's change) and `merge` (the expert-merging warm-up). Until the split they were one `spes` section;
spes/config/renamed.py maps the former names."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from spes.config.choices import (
    ACTIVATION_CHECKPOINTING,
    AUTOCAST_DTYPES,
    CODECS,
    EXPERT_OUTER,
    FROZEN_DTYPES,
    METHODS,
    NODE_PARALLEL,
    OVERLAPS,
    SCHEDULES,
    SHARED_OUTER,
    need,
)


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    decay_norms: bool = False
    """Apply weight decay to norm weights too (the reference decays every parameter); False = matrices only."""
    schedule: str = "cosine"
    """After the linear warm-up: 'cosine' (to lr * min_lr_ratio at the last step: every step's rate depends on
    the total, so a longer run is another run) or 'wsd' (warm-up, stable, decay: lr until the last
    `decay_fraction` of the steps, then linear to lr * min_lr_ratio; a run extended with more rounds keeps
    its rounds of the stable phase)."""
    decay_fraction: float = 0.2
    """wsd: the share of the total steps over which the rate decays."""

    def validate(self, key: str) -> None:
        """`key`: where this optimizer sits (train.optim, dense.optim)."""
        o = self
        need(o.schedule in SCHEDULES, f"{key}.schedule must be one of {'|'.join(SCHEDULES)}, got {o.schedule!r}")
        need(0.0 < o.decay_fraction <= 1.0, f"{key}.decay_fraction must be in (0, 1], got {o.decay_fraction}")
        need(o.lr > 0, f"{key}.lr must be > 0, got {o.lr}")
        need(0.0 <= o.min_lr_ratio <= 1.0, f"{key}.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
        need(o.warmup_steps >= 0, f"{key}.warmup_steps must be >= 0, got {o.warmup_steps}")
        need(o.weight_decay >= 0, f"{key}.weight_decay must be >= 0, got {o.weight_decay}")
        need(0.0 <= o.beta1 < 1.0, f"{key}.beta1 must be in [0, 1), got {o.beta1}")
        need(0.0 <= o.beta2 < 1.0, f"{key}.beta2 must be in [0, 1), got {o.beta2}")
        need(o.grad_clip >= 0, f"{key}.grad_clip must be >= 0 (0 = off), got {o.grad_clip}")


@dataclass
class MergeConfig:
    """Expert-merging warm-up, applied by the aggregator at sync steps."""

    enabled: bool = True
    interval: int = 50
    """Merge at sync steps where step % interval == 0."""
    alpha_start: float = 0.05
    decay_steps: int = 200
    """alpha = alpha_start * (1 - step / decay_steps), clipped at 0."""
    top_k: int = 4
    """Donors per expert: the most cosine-similar other experts by gate weights."""

    def validate(self) -> None:
        need(self.interval >= 1 and self.decay_steps >= 1 and self.top_k >= 1,
             "merge.interval/decay_steps/top_k must be >= 1")
        need(0.0 <= self.alpha_start <= 1.0, f"merge.alpha_start must be in [0, 1], got {self.alpha_start}")


@dataclass
class SyncConfig:
    """Who trains what, how often the nodes synchronise, and what crosses the link at a sync
    (spes/sync/: the methods, spes/sync/deltas.py and spes/sync/codecs.py for the wire)."""

    method: str = "spes"
    """'spes', 'diloco', 'fedavg', 'fedadam' (a server Adam step, Reddi et al. 2021) or 'centralized' (one node,
    num_nodes x train.batch_size)."""
    num_nodes: int = 2
    ownership: Optional[list[list[int]]] = None
    """Explicit expert ids per node; None = contiguous blocks."""
    every_steps: int = 50
    """Local optimizer steps per round: the nodes synchronise every this many steps."""
    rounds: int = 10
    """Total sync rounds."""
    warmup_rounds: int = 4
    """Rounds run by the `warmup` stage (merging on); the `train` stage runs the rest."""
    token_weighted: bool = False
    """Weight the shared-parameter mean by tokens each node trained on."""
    codec: str = "fp32"
    """Encoding of the deltas nodes upload and download: 'fp32' (exact), 'bf16', 'int8' (blockwise absmax)."""
    error_feedback: bool = True
    """With a lossy codec, keep each encoding's error and add it to the next round's delta (nodes keep theirs
    in their local state, the aggregator its own beside the global model)."""
    int8_block: int = 256
    """Values per int8 scale (one fp32 scale per block)."""
    average_optimizer_state: bool = False
    """At each sync, nodes also upload their Adam moments (exp_avg, exp_avg_sq, fp32) of the averaged
    parameters (SPES: the shared ones; the baselines: all), the aggregator averages them with the deltas'
    weights into the global bundle, and every node continues from that mean (its step counts its own).
    Costs twice those parameters' fp32 bytes up and down per round."""

    overlap: str = "none"
    """'none': a node starts round r from global r-1. 'one_round': the sync hidden behind compute (DiLoCo's
    eager overlap, Kale et al. 2025): a node starts round r from its own model after round r-1 (global r-2
    plus its own delta of round r-1), so it need not wait for global r-1, and folds global r-1 in at the end
    of round r: it uploads its round-r delta d (what it trained in round r) against global r-1 and goes on
    from global r-1 + d. Its own update counts once; others' experts take their committed values one round
    late. The committed globals are the same protocol as without overlap (spes/round/inputs.py)."""

    max_delta_norm_ratio: Optional[float] = None
    """For runs with nodes one does not fully control: an upload whose delta of an averaged tensor has a norm
    over this many times the median of the other nodes' deltas of that tensor is set aside, as a damaged
    upload is (its node re-runs the round, or is left out under the quorum). None = off. Every decoded
    upload tensor is checked to be finite whatever this is."""

    @property
    def total_steps(self) -> int:
        return self.rounds * self.every_steps

    def validate(self) -> None:
        s = self
        need(s.method in METHODS, f"sync.method must be one of {'|'.join(METHODS)}, got {s.method!r}")
        need(s.num_nodes >= 1, "sync.num_nodes must be >= 1")
        need(s.method == "spes" or s.ownership is None,
             f"sync.ownership is only used by sync.method=spes (got method {s.method!r})")
        need(s.every_steps >= 1, "sync.every_steps must be >= 1")
        need(s.rounds >= 1, f"sync.rounds must be >= 1, got {s.rounds}")
        need(0 <= s.warmup_rounds <= s.rounds, f"sync.warmup_rounds ({s.warmup_rounds}) must be in [0, sync.rounds={s.rounds}]")
        need(s.codec in CODECS, f"sync.codec must be one of {'|'.join(CODECS)}, got {s.codec!r}")
        need(s.int8_block >= 1, f"sync.int8_block must be >= 1, got {s.int8_block}")
        need(s.max_delta_norm_ratio is None or s.max_delta_norm_ratio > 1,
             f"sync.max_delta_norm_ratio must be > 1 or null, got {s.max_delta_norm_ratio}")
        need(s.overlap in OVERLAPS, f"sync.overlap must be one of {'|'.join(OVERLAPS)}, got {s.overlap!r}")
        need(s.overlap == "none" or not s.average_optimizer_state,
             "sync.overlap one_round cannot be used with sync.average_optimizer_state: the moments' mean of "
             "round r-1 arrives after round r has started")


@dataclass
class TrainConfig:
    """Each node's local training between syncs (spes/train/trainer.py); the dense stage's trainer reads its
    `autocast` too."""

    batch_size: int = 8
    """Sequences per optimizer step on each node (split over its ranks and micro-batches)."""
    micro_batch_size: Optional[int] = None
    """Sequences per forward/backward pass; the step accumulates gradients over batch_size / (ranks x
    micro_batch_size) of them. None = the whole per-rank batch at once. The load-balance loss is computed
    per micro-batch and averaged (spes.model.losses.grouped_load_balance_loss), so the step's loss and gradients
    do not depend on how the batch is split into ranks and micro-batches beyond that grouping."""
    activation_checkpointing: str = "none"
    """'none', or 'block': keep only each transformer block's input and recompute the rest in the backward
    pass (less activation memory for about one more forward pass; the same numbers)."""
    node_parallel: str = "ddp"
    """How the ranks of a node (orchestration.gpus_per_node > 1) share its work: 'ddp' = each rank holds the
    whole node (weights, gradients, AdamW state) and takes its share of every batch; 'fsdp' = the same data
    parallel steps with weights, gradients and AdamW state sharded over the ranks (FSDP2, per block), frozen
    experts included (spes/train/sharding.py). Equal results within fp32 rounding."""
    compile: bool = False
    """torch.compile each transformer block (first steps of each node process pay the compile time)."""
    seq_len: int = 128
    seed: int = 0
    decayed_lb: bool = False
    """Own-expert load-balance factor rising 0.7 -> 1.0 over the first 20% of steps."""
    frozen_dtype: str = "float32"
    """Storage dtype of frozen experts on a node ('float32' or 'bfloat16')."""
    autocast: Optional[str] = None
    """Mixed precision of the forward pass: None (fp32), 'bfloat16' or 'float16' (torch.autocast)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=0.002, warmup_steps=10))

    def validate(self) -> None:
        t = self
        need(t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}")
        need(t.node_parallel in NODE_PARALLEL, f"train.node_parallel must be one of {'|'.join(NODE_PARALLEL)}, "
                                               f"got {t.node_parallel!r}")
        need(t.activation_checkpointing in ACTIVATION_CHECKPOINTING,
             f"train.activation_checkpointing must be {'|'.join(ACTIVATION_CHECKPOINTING)}, got {t.activation_checkpointing!r}")
        t.optim.validate("train.optim")
        need(t.frozen_dtype in FROZEN_DTYPES, f"train.frozen_dtype must be {'|'.join(FROZEN_DTYPES)}, got {t.frozen_dtype!r}")
        need(t.autocast in AUTOCAST_DTYPES, f"train.autocast must be null|bfloat16|float16, got {t.autocast!r}")


@dataclass
class OuterConfig:
    """The outer (server) step: how the nodes' mean delta of an averaged tensor becomes the global's change
    (spes/sync/outer.py, spes/sync/fedadam.py)."""

    shared: str = "average"
    """spes only: how the nodes' deltas of the shared parameters become the global's change: 'average' (the
    paper: their mean) or 'nesterov' (DiLoCo's outer SGD step on their mean, with lr, momentum and nesterov
    below; experts still come from their owners)."""
    experts: str = "owner"
    """spes only: how each expert's delta from its owner becomes the global's change: 'owner' (the paper: the
    owner's delta as is) or 'nesterov' (the same outer SGD step as outer.shared's, on each expert's rows, with a
    momentum buffer per expert tensor kept beside the global; an expert that changes owner keeps its rows of
    it; rows whose owner is absent from a round keep their value and their momentum)."""
    lr: float = 0.7
    """The outer learning rate: DiLoCo's SGD (0.7), spes with shared nesterov, FedAdam's Adam (there about
    1e-2..1e-1: Adam's steps are normalised, 0.7 is far too large)."""
    momentum: float = 0.9
    """DiLoCo's outer momentum; FedAdam's beta1."""
    nesterov: bool = True
    beta2: float = 0.99
    """FedAdam: the server Adam's beta2 (Reddi et al. 2021: 0.99)."""
    eps: float = 1e-3
    """FedAdam: the server Adam's epsilon (Reddi et al.'s tau, 1e-3: bounds the step where beta2's average is tiny)."""

    def validate(self) -> None:
        o = self
        need(o.shared in SHARED_OUTER, f"outer.shared must be {'|'.join(SHARED_OUTER)}, got {o.shared!r}")
        need(o.experts in EXPERT_OUTER, f"outer.experts must be {'|'.join(EXPERT_OUTER)}, got {o.experts!r}")
        need(o.lr > 0, f"outer.lr must be > 0, got {o.lr}")
        need(0.0 <= o.momentum < 1.0, f"outer.momentum must be in [0, 1), got {o.momentum}")
        need(0.0 <= o.beta2 < 1.0, f"outer.beta2 must be in [0, 1), got {o.beta2}")
        need(o.eps > 0, f"outer.eps must be > 0, got {o.eps}")
