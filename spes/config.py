"""The one configuration: `params.yaml` read through OmegaConf structured configs.

Every section is a dataclass with a docstring per field; `load_params` merges the YAML
(and dotlist overrides) onto the schema, so unknown keys and wrong types fail at load time,
and `validate` checks the cross-field invariants before any compute starts.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


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
    """fsspec storage options, e.g. {endpoint_url: http://127.0.0.1:5000, key: ..., secret: ...}."""


@dataclass
class OrchestrationConfig:
    run_name: str = "default"
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


_METHODS = ("spes", "diloco", "fedavg", "centralized")


def validate(p: Params) -> Params:
    """Cross-field checks; raises ConfigError naming the key."""
    m, s = p.model, p.spes

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    need(m.hidden_size > 0 and m.num_layers > 0, "model.hidden_size and model.num_layers must be > 0")
    need(m.num_heads > 0 and m.num_heads % m.num_kv_heads == 0,
         f"model.num_heads ({m.num_heads}) must be a multiple of model.num_kv_heads ({m.num_kv_heads})")
    need(m.head_dim is not None or m.hidden_size % m.num_heads == 0,
         f"model.hidden_size ({m.hidden_size}) not divisible by model.num_heads ({m.num_heads}); set model.head_dim")
    need(m.dim_per_head % 2 == 0, f"head dim ({m.dim_per_head}) must be even for RoPE")
    need(m.qk_norm in ("full", "head", "none"), f"model.qk_norm must be full|head|none, got {m.qk_norm!r}")
    need(m.num_experts >= 0, "model.num_experts must be >= 0")
    if m.is_moe:
        need(1 <= m.top_k <= m.num_experts,
             f"model.top_k ({m.top_k}) must be between 1 and model.num_experts ({m.num_experts})")
    need(s.method in _METHODS, f"spes.method must be one of {_METHODS}, got {s.method!r}")
    need(s.num_nodes >= 1, "spes.num_nodes must be >= 1")
    if s.method == "centralized":
        need(s.num_nodes == 1, f"spes.method=centralized needs spes.num_nodes=1, got {s.num_nodes}")
    if s.method == "spes":
        need(m.is_moe, "spes.method=spes needs an MoE model (model.num_experts > 0)")
        if s.ownership is None:
            need(m.num_experts % s.num_nodes == 0,
                 f"model.num_experts ({m.num_experts}) is not divisible by spes.num_nodes ({s.num_nodes}); "
                 "change one or give spes.ownership explicitly")
    need(s.sync_steps >= 1, "spes.sync_steps must be >= 1")
    need(0 <= s.warmup_rounds <= s.rounds, f"spes.warmup_rounds ({s.warmup_rounds}) must be in [0, spes.rounds={s.rounds}]")
    need(s.seq_len <= m.max_seq_len, f"spes.seq_len ({s.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")
    need(p.dense.seq_len <= m.max_seq_len, f"dense.seq_len ({p.dense.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")
    need(p.eval.seq_len <= m.max_seq_len, f"eval.seq_len ({p.eval.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")
    need(s.frozen_dtype in ("float32", "bfloat16"), f"spes.frozen_dtype must be float32|bfloat16, got {s.frozen_dtype!r}")
    need(p.init.mode in ("scratch", "upcycle"), f"init.mode must be scratch|upcycle, got {p.init.mode!r}")
    need(0.0 <= p.init.noise_fraction <= 1.0, "init.noise_fraction must be in [0, 1]")
    need(p.tokenize.corpus_format in ("auto", "text", "json", "parquet"),
         f"tokenize.corpus_format must be auto|text|json|parquet, got {p.tokenize.corpus_format!r}")
    need(0.0 < p.tokenize.val_fraction < 0.5, "tokenize.val_fraction must be in (0, 0.5)")
    if p.tokenize.corpus is not None and "://" not in p.tokenize.corpus:
        import glob

        need(bool(glob.glob(os.path.expanduser(p.tokenize.corpus))),
             f"tokenize.corpus: no file matches {p.tokenize.corpus!r}")
    mn = p.orchestration.min_nodes
    need(mn is None or 1 <= mn <= s.num_nodes, f"orchestration.min_nodes ({mn}) must be in [1, spes.num_nodes={s.num_nodes}]")
    need(s.autocast in (None, "bfloat16", "float16"), f"spes.autocast must be null|bfloat16|float16, got {s.autocast!r}")
    need(bool(DEVICE_PATTERN.match(p.orchestration.device)),
         f"orchestration.device must be auto|cpu|cuda|cuda:K, got {p.orchestration.device!r}")
    need(p.orchestration.executor in ("process", "deployment"),
         f"orchestration.executor must be process|deployment, got {p.orchestration.executor!r}")
    mg = s.merge
    need(mg.interval >= 1 and mg.decay_steps >= 1 and mg.top_k >= 1, "spes.merge.interval/decay_steps/top_k must be >= 1")
    if m.is_moe and mg.enabled:
        need(mg.top_k < m.num_experts, f"spes.merge.top_k ({mg.top_k}) must be < model.num_experts ({m.num_experts})")
    if s.ownership is not None:
        from spes.ownership import Ownership

        Ownership.from_lists(s.ownership, m.num_experts)  # raises OwnershipError (a ConfigError)
    return p


def load_params(path: str = "params.yaml", overrides: Optional[list[str]] = None) -> Params:
    """Read `path` onto the schema, apply `key=value` overrides, validate. One error line on failure."""
    if not os.path.exists(path):
        raise ConfigError(f"params file not found: {path}")
    schema = OmegaConf.structured(Params)
    try:
        merged = OmegaConf.merge(schema, OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides or [])))
        params: Params = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {str(e).splitlines()[0]} (key: {getattr(e, 'full_key', '?')})") from None
    return validate(params)


def params_from_dict(d: dict) -> Params:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Params), OmegaConf.create(d))
        params: Params = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(f"{str(e).splitlines()[0]} (key: {getattr(e, 'full_key', '?')})") from None
    return validate(params)


def to_dict(obj: Any) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(obj), resolve=True)  # type: ignore[return-value]
