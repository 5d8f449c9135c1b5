"""Names and shapes of the canonical state dict (the format on storage and for HF export), without a model.

Canonical names are Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...); a layer's experts are two
3-D tensors, `model.layers.N.mlp.experts.gate_up_proj` (E x 2I x D) and `...down_proj` (E x D x I). Inside the
model they are held in chunks (`...mlp.experts.chunks.K.gate_up_proj`, spes/model/moe.py), which never
leave it. Every "is this an expert tensor" question is answered here.
"""
from __future__ import annotations

from spes.config.schema import ModelConfig

EXPERT_TENSORS = ("down_proj", "gate_up_proj")
"""A layer's expert tensors, in the order a name-sorted file holds them."""


def expert_tensor(layer: int, kind: str) -> str:
    """Canonical name of layer `layer`'s expert tensor `kind` (gate_up_proj or down_proj)."""
    return f"model.layers.{layer}.mlp.experts.{kind}"


def is_expert_param(canonical_name: str) -> bool:
    return ".mlp.experts." in canonical_name


def is_chunk_param(param_name: str) -> bool:
    """A model parameter that is a chunk of a layer's experts (not itself a canonical tensor)."""
    return ".mlp.experts.chunks." in param_name


def expert_layer(canonical_name: str) -> str:
    """The layer part of an expert tensor's name (`model.layers.N.mlp.experts`): a layer's expert tensors
    share it, so they are adjacent in any name-sorted list."""
    return canonical_name.rsplit(".", 1)[0]


def expert_kind(canonical_name: str) -> str:
    """'gate_up_proj' or 'down_proj' of an expert tensor name."""
    return canonical_name.rsplit(".", 1)[-1]


def canonical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the canonical state dict of a model with this config (no model is built)."""
    D, V, hd = cfg.hidden_size, cfg.vocab_size, cfg.dim_per_head
    H, Hkv, I, E = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.num_experts
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    norm_dims = {"full": (H * hd, Hkv * hd), "head": (hd, hd)}.get(cfg.qk_norm)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (H * hd, D), p + "self_attn.k_proj.weight": (Hkv * hd, D),
                       p + "self_attn.v_proj.weight": (Hkv * hd, D), p + "self_attn.o_proj.weight": (D, H * hd)})
        if norm_dims:
            shapes[p + "self_attn.q_norm.weight"], shapes[p + "self_attn.k_norm.weight"] = (norm_dims[0],), (norm_dims[1],)
        if cfg.is_moe:
            shapes.update({p + "mlp.gate.weight": (E, D), p + "mlp.experts.gate_up_proj": (E, 2 * I, D),
                           p + "mlp.experts.down_proj": (E, D, I)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D),
                           p + "mlp.down_proj.weight": (D, I)})
    return shapes
