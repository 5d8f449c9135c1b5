"""The configuration schema: one dataclass per section of `params.yaml`, a docstring per field.

The defaults here are the embedded default's values (params.yaml sets them explicitly too, as
documentation; tests/spes/config/test_loader.py keeps the two equal), so a unit test that builds `Params()`
and `dvc repro` compute the same thing.

`spes/config/loader.py` reads the YAML onto this schema (unknown keys and wrong types fail there) and
validates the cross-field invariants before any compute starts. Nothing here touches the filesystem.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from spes.errors import ConfigError

# The choices of every enumerated setting, here at the bottom so that validation and the modules that branch
# on them (which import these) agree. fullmatch everywhere: a trailing newline is no valid choice.
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda|cuda:\d+")
EXPERTS_IMPLS = ("auto", "grouped_mm", "triton", "loop")
METHODS = ("spes", "diloco", "fedavg", "centralized", "fedadam")
"""Sync methods (spes/sync/methods.py's registry builds the object for each; a test keeps the two equal)."""
CODECS = ("fp32", "bf16", "int8")
DATA_ORDERS = ("epoch", "random_windows")
QK_NORMS = ("full", "head", "none")
SCHEDULES = ("cosine", "wsd")
LOSS_IMPLS = ("plain", "chunked")
NODE_PARALLEL = ("ddp", "fsdp")
TRAINING_FIELDS = ("lb_loss_coef", "z_loss_coef", "z_loss_reduction", "lm_head_z_loss_coef", "loss_impl",
                   "loss_chunk_tokens", "experts_impl")
"""ModelConfig fields that are training settings, not architecture: a node takes them from the run's params,
not from the model config recorded with the initial model (see model_for_training)."""

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""Names that become folder names on storage (run names, variant names): no '/', no leading '.'."""


def check_name(value: str, key: str) -> str:
    if not isinstance(value, str) or not SAFE_NAME.fullmatch(value) or ".." in value:
        raise ConfigError(f"{key}: {value!r} is not a safe name (letters, digits, '.', '_', '-'; "
                          "starting with a letter or digit; no '..')")
    return value


@dataclass
class ModelConfig:
    """Decoder-only transformer of the OLMoE family (MoE) or its dense counterpart."""

    vocab_size: int = 4096
    """Embedding rows; must be >= the tokenizer's vocabulary."""
    hidden_size: int = 128
    intermediate_size: int = 256
    """Width of each expert's SwiGLU MLP (and of the dense MLP)."""
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: Optional[int] = None
    """None = hidden_size // num_heads."""
    num_experts: int = 8
    """0 = dense model (plain SwiGLU MLP in every layer)."""
    top_k: int = 2
    norm_topk_prob: bool = True
    """Renormalize the top-k gate probabilities to sum to 1 (OLMoE: False, Qwen3-MoE: True)."""
    qk_norm: str = "head"
    """'full': RMSNorm over all heads (OLMoE); 'head': per-head RMSNorm (Qwen3); 'none' (Llama)."""
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_seq_len: int = 256
    tie_embeddings: bool = False
    init_std: float = 0.02
    lb_loss_coef: float = 0.01
    """Switch load-balancing loss weight."""
    z_loss_coef: float = 0.001
    """Router z-loss weight."""
    z_loss_reduction: str = "sum"
    """How the per-layer router z-losses combine: 'sum' (the reference: megablocks returns one term per
    router and they are added) or 'mean' over layers (num_layers times weaker)."""
    lm_head_z_loss_coef: float = 0.0
    """Weight of the LM-head z-loss mean(logsumexp(logits)^2); the reference uses 1e-5. 0 = off."""
    loss_impl: str = "plain"
    """How the LM head and the loss compute in training: 'plain' (the full logits, B x S x V) or 'chunked'
    (spes.model.losses.chunked_linear_cross_entropy: the logits of `loss_chunk_tokens` tokens at a time,
    recomputed in the backward pass; loss and gradients equal the plain path within fp32 rounding, memory
    for the loss a chunk's). An implementation choice, not part of the maths: not in the run fingerprint."""
    loss_chunk_tokens: int = 4096
    experts_impl: str = "auto"
    """How the experts compute: 'auto' (torch grouped_mm where it has a kernel, else Triton on CUDA, else a
    loop), or one of 'grouped_mm', 'triton', 'loop' pinned (tests and benchmarks compare them). An
    implementation choice, not part of the maths: it is not in the run fingerprint."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


def model_for_training(recorded: dict, params_model: "ModelConfig") -> "ModelConfig":
    """The architecture recorded with a run's model, with the training settings of the run's params: a
    variant's loss coefficients (or loss implementation) take effect instead of round 0's."""
    import dataclasses

    return dataclasses.replace(ModelConfig(**recorded), **{k: getattr(params_model, k) for k in TRAINING_FIELDS})


@dataclass
class TokenizeConfig:
    """Corpus -> tokenizer -> token shards (spes/data/corpus.py, spes/data/tokenization.py), streamed."""

    corpus: Optional[str] = None
    """Corpus files: a path, glob or fsspec URL (s3://...), several separated by commas. None (and no
    `dataset`) = the Python stdlib's source."""
    corpus_format: str = "auto"
    """'auto' (by extension), 'text' (a file is a document), 'json' (jsonl, or a JSON array) or 'parquet'."""
    text_field: str = "text"
    """The field (json) or column (parquet, hub datasets) that holds a document's text."""
    dataset: Optional[str] = None
    """A Hugging Face hub dataset id, instead of `corpus` (read with `datasets.load_dataset`)."""
    dataset_name: Optional[str] = None
    """The hub dataset's configuration name, if it has several."""
    dataset_split: str = "train"
    streaming: bool = True
    """Stream the hub dataset (nothing downloaded in full, nothing cached in Arrow files)."""
    skip_bad_files: bool = False
    """Skip (and count) corpus files that cannot be read or decoded, instead of stopping with their name."""
    max_files: int = 400
    """Cap on corpus files when the default (stdlib) corpus is used."""
    tokenizer: Optional[str] = None
    """A pretrained tokenizer (tokenizer.json file, folder or hub id); None = train a byte-level BPE."""
    eos_token: Optional[str] = None
    """The token that ends every document; None = the tokenizer's own EOS or a known name (<|endoftext|>, </s>...)."""
    bpe_sample_docs: int = 20000
    """Documents (the first ones) the BPE is trained on: a bounded sample, not the whole corpus."""
    shard_tokens: int = 1 << 28
    """Tokens per shard file (2^28 = 512 MiB of uint16)."""
    val_fraction: float = 0.13
    """Share of documents held out, by a keyed hash of each document (stable under streaming and re-runs);
    on the embedded default enough (>= 40 documents, >= 200k tokens) to tell variants 0.5% apart."""
    seed: int = 0
    """Key of the held-out hash."""


@dataclass
class DataConfig:
    order: str = "epoch"
    """How nodes read training windows (spes/data/order.py): 'epoch' = each epoch a permutation of the
    non-overlapping windows, split disjointly across nodes; 'random_windows' = uniformly random windows with
    replacement per node (what the reference does)."""


@dataclass
class InitConfig:
    mode: str = "upcycle"
    """'scratch' = random MoE init; 'upcycle' = each expert a copy of a dense MLP."""
    dense_checkpoint: Optional[str] = None
    """HF dense checkpoint (path or hub id) to upcycle; None = the `dense` stage's model."""
    noise_std: float = 0.0
    noise_fraction: float = 0.5
    """Fraction of each expert's weights that receive Gaussian noise."""
    router_init_std: float = 0.02
    """Router weights ~ N(0, std) at init (upcycled or scratch); 0 = zeros, the reference's default."""
    seed: int = 0


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


@dataclass
class DenseConfig:
    """Short dense pre-training whose HF checkpoint the `upcycle` stage consumes."""

    steps: int = 150
    batch_size: int = 8
    seq_len: int = 128
    seed: int = 0
    export_arch: str = "auto"
    """HF architecture to write: 'auto' (Qwen3 if qk_norm='head' else Llama), 'qwen3', 'llama'."""
    optim: OptimConfig = field(default_factory=OptimConfig)


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


@dataclass
class SpesConfig:
    method: str = "spes"
    """'spes', 'diloco', 'fedavg', 'fedadam' (a server Adam step, Reddi et al. 2021) or 'centralized' (one node,
    num_nodes x batch_size)."""
    num_nodes: int = 2
    ownership: Optional[list[list[int]]] = None
    """Explicit expert ids per node; None = contiguous blocks."""
    sync_steps: int = 50
    warmup_rounds: int = 4
    """Rounds run by the `warmup` stage (merging on); the `train` stage runs the rest."""
    rounds: int = 10
    """Total sync rounds."""
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
    token_weighted: bool = False
    """Weight the shared-parameter mean by tokens each node trained on."""
    decayed_lb: bool = False
    """Own-expert load-balance factor rising 0.7 -> 1.0 over the first 20% of steps."""
    frozen_dtype: str = "float32"
    """Storage dtype of frozen experts on a node ('float32' or 'bfloat16')."""
    autocast: Optional[str] = None
    """Mixed precision of the forward pass: None (fp32), 'bfloat16' or 'float16' (torch.autocast)."""
    outer_lr: float = 0.7
    """The outer (server) learning rate: DiLoCo's SGD (0.7), spes with shared_outer nesterov, FedAdam's Adam
    (there about 1e-2..1e-1: Adam's steps are normalised, 0.7 is far too large)."""
    outer_momentum: float = 0.9
    """DiLoCo's outer momentum; FedAdam's beta1."""
    outer_nesterov: bool = True
    outer_beta2: float = 0.99
    """FedAdam: the server Adam's beta2 (Reddi et al. 2021: 0.99)."""
    outer_eps: float = 1e-3
    """FedAdam: the server Adam's epsilon (Reddi et al.'s tau, 1e-3: bounds the step where beta2's average is tiny)."""
    shared_outer: str = "average"
    """spes only: how the nodes' deltas of the shared parameters become the global's change: 'average' (the
    paper: their mean) or 'nesterov' (DiLoCo's outer SGD step on their mean, with outer_lr, outer_momentum and
    outer_nesterov; experts still come from their owners)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=0.002, warmup_steps=10))
    merge: MergeConfig = field(default_factory=MergeConfig)

    @property
    def total_steps(self) -> int:
        return self.rounds * self.sync_steps


@dataclass
class SyncConfig:
    """What crosses the link at a sync (spes/sync/deltas.py, spes/sync/codecs.py)."""

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


@dataclass
class CheckpointConfig:
    every_rounds: int = 5
    """Nodes also write their state (optimizer, data position, residual) to shared storage every this many
    rounds and at the last round of a stage; in between it stays on the node (orchestration.node_state_dir).
    A run resumes from any machine at such rounds, from the nodes' own folders at the others."""
    keep_last: Optional[int] = None
    """With storage.keep_rounds set: keep only the last this many rounds resumable from shared storage
    (None = all of them; round 0 is always kept)."""


@dataclass
class StorageConfig:
    url: str = "artifacts/storage"
    """fsspec URL of shared storage: a local folder or s3://bucket/prefix."""
    options: dict[str, Any] = field(default_factory=dict)
    """fsspec storage options, e.g. {endpoint_url: http://127.0.0.1:5000}; credentials preferably from AWS_*."""
    timeout_s: float = 30.0
    """Connect and read timeout of one storage call (S3); a call that hangs longer is retried."""
    retries: int = 4
    """Retries of a failed storage call (exponential backoff from 0.5 s, each logged), then the call fails."""
    keep_rounds: Optional[int] = 2
    """Keep the last K rounds whole (their deltas refer to the round's node uploads); older rounds keep only
    their record, except round 0 and the rounds a resume can start from from shared storage, which keep
    their global and the node states they need. None = keep everything."""
    keep_superseded: Optional[int] = 2
    """Rounds set aside (a resume from an earlier round, a superseded run, a damaged round) go to
    runs/<run>/superseded/<stamp>/; keep the last this many stamps. None = keep them all."""


@dataclass
class OrchestrationConfig:
    run_name: str = "default"
    """Names the run's folder on storage: letters, digits, '.', '_' and '-' only."""
    supersede: bool = False
    """When storage holds a run of this name made with other settings or another initial model: false =
    stop with an error saying so (choose another run_name, or set this); true = set its rounds aside to
    superseded/ and start it anew."""
    fresh: bool = False
    """Start this run anew even when storage holds it with the same settings (e.g. after a code change, which
    the fingerprint does not see): its rounds are set aside to superseded/."""
    executor: str = "process"
    """'process' = one subprocess per node on this machine; 'deployment' = run_deployment per node."""
    node_deployment: str = "spes-node/spes-node-{node}"
    """Deployment '<flow>/<name>' node i runs on ({node} is replaced by i): each machine serves the nodes it
    holds (`python -m pipelines.node_flow --nodes 0,1`), so a node always runs where its state is. Without
    {node}, every node runs on whichever machine takes it: only sound when its state comes from storage
    (checkpoint.every_rounds: 1)."""
    spare_deployment: Optional[str] = None
    """A deployment served by machines that can take any node (`node_flow --spare`): a node lost with its
    machine is retried there when its state allows (on shared storage, or none yet), the run saying so."""
    heartbeat_timeout_s: float = 60.0
    """Deployment nodes rewrite a heartbeat on shared storage every timeout/4; a node silent this long (its
    machine dead, or never picked up) is declared lost: its flow run is cancelled and it is retried
    (orchestration.node_retries) or left out under the quorum."""
    device: str = "auto"
    """Where nodes (and the dense stage) compute: auto | cpu | cuda | cuda:K (see spes/train/devices.py)."""
    node_cache_dir: str = "~/.cache/spes"
    """Deployment nodes keep the token shards fetched from shared storage here (on their own machine)."""
    node_state_dir: Optional[str] = None
    """Each node's own state between rounds, on its own machine (spes/run/node_state.py);
    None = <node_cache_dir>/state."""
    gpus_per_node: int = 1
    """Ranks of one node: >1 runs each node round as a torchrun job, data parallel (DDP) over the node's
    devices (GPUs, or CPU processes with gloo where device is cpu); rank 0 alone reads and writes storage."""
    threads_per_node: Optional[int] = None
    """Torch threads per node process; None = this machine's cores shared among the nodes it runs (process
    executor), all of them for a deployment node."""
    node_retries: int = 2
    round_timeout_s: float = 900.0
    """Nodes not committed by then are left out of the round (quorum permitting)."""
    min_nodes: Optional[int] = None
    """Quorum; None = all members."""
    membership_plan: list[str] = field(default_factory=list)
    """Planned membership changes, e.g. ['leave 1 after 4', 'join 2 after 70%']: each is asked for (as with
    `python -m spes.members`) when its round starts and applied when that round is aggregated; a joiner's first
    round is the next one. Spot machines with a known end, or the churn study of compare-churn."""
    evict_after_rounds: int = 0
    """A member that misses this many rounds in a row is evicted at the end of the last of them: its experts go
    to the other members (spes/run/membership.py), who train them from the next round on. 0 = never: its
    experts stay at their last committed value while it is away."""
    log_every_steps: int = 10
    """Each node logs its step, loss, tokens/s and the seconds left in the round every this many steps
    (relayed to its node task's log in the Prefect UI); 0 = never."""
    lock_ttl_s: float = 600.0
    """The run's writer lease on storage; refreshed every ttl/3 while a flow runs, free again after a crash."""


@dataclass
class EvalConfig:
    batches: Optional[int] = None
    """Batches of the held-out split the `evaluate` stage scores; None = all of it (the default)."""
    batch_size: int = 8
    seq_len: int = 128
    every_rounds: int = 1
    """Held-out loss of the committed global every this many rounds (0 = never), on the first
    `round_batches` batches: shown in the round's Prefect table and stored in its record."""
    round_batches: int = 16
    round_windows: str = "spread"
    """Which windows the per-round held-out loss uses: 'spread' = evenly spaced over the whole split (each
    document about its share: an estimate of the whole split's loss), 'first' = the first ones (before
    2026-12: 16 batches of the default split came from 5 of its 46 documents)."""
    lm_eval_tasks: list[str] = field(default_factory=list)
    """lm-eval task names (or names defined in `lm_eval_include`); empty = skip."""
    lm_eval_include: Optional[str] = None
    lm_eval_limit: Optional[int] = None


@dataclass
class CompareConfig:
    """The comparison pipeline (compare/dvc.yaml): every variant x seed x lr x budget as its own run."""

    variants: dict[str, list[str]] = field(default_factory=dict)
    """Name -> `key=value` overrides (params.yaml lists spes, spes-no-merge, diloco, fedavg, centralized,
    spes-4nodes, spes-int8). All variants train on the same tokens from the same initial model (the per-node
    batch shrinks where nodes are added: 'spes-4nodes' halves it). Empty here: a dict default would be
    merged into, not replaced by, the one in params.yaml."""
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    """spes.seed of each repeat (data order and node randomness; the initial model stays the same)."""
    lrs: list[float] = field(default_factory=lambda: [0.002])
    """The learning-rate sweep every variant gets (the best of each is reported, the sweep is shown)."""
    budgets: list[int] = field(default_factory=lambda: [1])
    """Token budgets as multiples of spes.rounds (e.g. [1, 4]): does the gap shrink with tokens?"""
    baseline: str = "centralized"
    """The variant the others are divided by (ratio_to_centralized)."""
    pairs: dict[str, str] = field(default_factory=dict)
    """Variant -> the variant it is set against (params.yaml: spes -> spes-no-merge): the report gives each
    pair's difference, paired by seed, lr and held-out window, its document-clustered and seed standard errors,
    and whether it is beyond both. A file that writes compare.variants replaces these too (they name variants)."""
    node_memory: Optional[str] = None
    """A memory budget per node for the report (weights + gradients + Adam, by the planner): a variant's name
    (what one of its nodes needs) or a size such as 40MiB. The report marks each variant within it or over it:
    the paper's question, which method gives the best model with the memory each machine has."""


@dataclass
class Params:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    init: InitConfig = field(default_factory=InitConfig)
    dense: DenseConfig = field(default_factory=DenseConfig)
    spes: SpesConfig = field(default_factory=SpesConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    orchestration: OrchestrationConfig = field(default_factory=OrchestrationConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    artifacts_dir: str = "artifacts"
