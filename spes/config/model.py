"""The `model` section: the architecture (and the loss settings a node trains it with)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from spes.config.choices import EXPERTS_IMPLS, LOSS_IMPLS, QK_NORMS, need

TRAINING_FIELDS = ("lb_loss_coef", "z_loss_coef", "z_loss_reduction", "lm_head_z_loss_coef", "loss_impl",
                   "loss_chunk_tokens", "experts_impl")
"""ModelConfig fields that are training settings, not architecture: a node takes them from the run's params,
not from the model config recorded with the initial model (see model_for_training)."""


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

    def validate(self) -> None:
        """The architecture's own invariants (a model config recorded with a run is read back through them)."""
        m = self
        need(m.vocab_size > 0, f"model.vocab_size must be > 0, got {m.vocab_size}")
        need(m.hidden_size > 0 and m.num_layers > 0, "model.hidden_size and model.num_layers must be > 0")
        need(m.intermediate_size > 0, f"model.intermediate_size must be > 0, got {m.intermediate_size}")
        need(m.num_heads > 0, f"model.num_heads must be > 0, got {m.num_heads}")
        need(m.num_kv_heads > 0, f"model.num_kv_heads must be > 0, got {m.num_kv_heads}")
        need(m.num_heads % m.num_kv_heads == 0,
             f"model.num_heads ({m.num_heads}) must be a multiple of model.num_kv_heads ({m.num_kv_heads})")
        need(m.head_dim is None or m.head_dim > 0, f"model.head_dim must be > 0 or null, got {m.head_dim}")
        need(m.head_dim is not None or m.hidden_size % m.num_heads == 0,
             f"model.hidden_size ({m.hidden_size}) not divisible by model.num_heads ({m.num_heads}); set model.head_dim")
        need(m.dim_per_head % 2 == 0, f"head dim ({m.dim_per_head}) must be even for RoPE")
        need(m.max_seq_len > 0, f"model.max_seq_len must be > 0, got {m.max_seq_len}")
        need(m.qk_norm in QK_NORMS, f"model.qk_norm must be {'|'.join(QK_NORMS)}, got {m.qk_norm!r}")
        need(m.num_experts >= 0, "model.num_experts must be >= 0")
        if m.is_moe:
            need(1 <= m.top_k <= m.num_experts,
                 f"model.top_k ({m.top_k}) must be between 1 and model.num_experts ({m.num_experts})")
        need(m.lb_loss_coef >= 0 and m.z_loss_coef >= 0 and m.lm_head_z_loss_coef >= 0,
             "model.lb_loss_coef, model.z_loss_coef and model.lm_head_z_loss_coef must be >= 0")
        need(m.z_loss_reduction in ("sum", "mean"), f"model.z_loss_reduction must be sum|mean, got {m.z_loss_reduction!r}")
        need(m.loss_impl in LOSS_IMPLS, f"model.loss_impl must be one of {'|'.join(LOSS_IMPLS)}, got {m.loss_impl!r}")
        need(m.loss_chunk_tokens >= 1, f"model.loss_chunk_tokens must be >= 1, got {m.loss_chunk_tokens}")
        need(m.experts_impl in EXPERTS_IMPLS, f"model.experts_impl must be one of {EXPERTS_IMPLS}, got {m.experts_impl!r}")
        need(m.rope_theta > 0, f"model.rope_theta must be > 0, got {m.rope_theta}")
        need(m.rms_norm_eps >= 0, f"model.rms_norm_eps must be >= 0, got {m.rms_norm_eps}")
        need(m.init_std >= 0, f"model.init_std must be >= 0, got {m.init_std}")


def model_for_training(recorded: dict, params_model: "ModelConfig") -> "ModelConfig":
    """The architecture recorded with a run's model, with the training settings of the run's params: a
    variant's loss coefficients (or loss implementation) take effect instead of round 0's."""
    return dataclasses.replace(ModelConfig(**recorded), **{k: getattr(params_model, k) for k in TRAINING_FIELDS})
