"""The configuration schema: one dataclass per section of `params.yaml`, a docstring per field.

`spes/params.py` reads the YAML onto this schema (unknown keys and wrong types fail there) and
validates the cross-field invariants before any compute starts. Nothing here touches the filesystem.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
EXPERTS_IMPLS = ("auto", "grouped_mm", "triton", "loop")


class ConfigError(ValueError):
    """A configuration problem, with a message naming the offending key."""


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
    norm_topk_prob: bool = False
    """Renormalize the top-k gate probabilities to sum to 1 (OLMoE: False, Qwen3-MoE: True)."""
    qk_norm: str = "full"
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

    def build(self):
        """The model this config describes (fresh random init)."""
        from spes.model import CausalLM  # the model module imports this one

        return CausalLM(self)


@dataclass
class TokenizeConfig:
    corpus: Optional[str] = None
    """Corpus files: a path, glob or fsspec URL (s3://...). None = the Python stdlib's source."""
    corpus_format: str = "auto"
    """'auto' (by extension), 'text', 'json' (also jsonl) or 'parquet'."""
    text_field: str = "text"
    max_files: int = 400
    """Cap on corpus files when the default (stdlib) corpus is used."""
    tokenizer: Optional[str] = None
    """A HF tokenizer (path, tokenizer.json or hub id); None = train a byte-level BPE."""
    val_fraction: float = 0.02
    seed: int = 0


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
    interval: int = 40
    """Merge at sync steps where step % interval == 0."""
    alpha_start: float = 0.05
    decay_steps: int = 200
    """alpha = alpha_start * (1 - step / decay_steps), clipped at 0."""
    top_k: int = 4
    """Donors per expert: the most cosine-similar other experts by gate weights."""


@dataclass
class SpesConfig:
    method: str = "spes"
    """'spes', 'diloco', 'fedavg' or 'centralized'."""
    num_nodes: int = 2
    ownership: Optional[list[list[int]]] = None
    """Explicit expert ids per node; None = contiguous blocks."""
    sync_steps: int = 20
    warmup_rounds: int = 5
    """Rounds run by the `warmup` stage (merging on); the `train` stage runs the rest."""
    rounds: int = 12
    """Total sync rounds."""
    batch_size: int = 8
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
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    optim: OptimConfig = field(default_factory=OptimConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)

    @property
    def total_steps(self) -> int:
        return self.rounds * self.sync_steps


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


@dataclass
class OrchestrationConfig:
    run_name: str = "default"
    """Names the run's folder on storage: letters, digits, '.', '_' and '-' only."""
    executor: str = "process"
    """'process' = one subprocess per node on this machine; 'deployment' = run_deployment per node."""
    node_deployment: str = "spes-node/spes-node"
    device: str = "auto"
    """Where nodes (and the dense stage) compute: auto | cpu | cuda | cuda:K (see spes/devices.py)."""
    node_cache_dir: str = "~/.cache/spes"
    """Deployment nodes keep the token shards fetched from shared storage here (on their own machine)."""
    threads_per_node: int = 1
    node_retries: int = 2
    round_timeout_s: float = 900.0
    """Nodes not committed by then are left out of the round (quorum permitting)."""
    min_nodes: Optional[int] = None
    """Quorum; None = all nodes."""
    lock_ttl_s: float = 600.0
    """The run's writer lease on storage; refreshed every ttl/3 while a flow runs, free again after a crash."""


@dataclass
class EvalConfig:
    batches: int = 16
    batch_size: int = 8
    seq_len: int = 128
    lm_eval_tasks: list[str] = field(default_factory=list)
    """lm-eval task names (or names defined in `lm_eval_include`); empty = skip."""
    lm_eval_include: Optional[str] = None
    lm_eval_limit: Optional[int] = None


@dataclass
class Params:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    init: InitConfig = field(default_factory=InitConfig)
    dense: DenseConfig = field(default_factory=DenseConfig)
    spes: SpesConfig = field(default_factory=SpesConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    orchestration: OrchestrationConfig = field(default_factory=OrchestrationConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    artifacts_dir: str = "artifacts"
