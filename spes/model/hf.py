"""Hugging Face interop: export to / import from `transformers` checkpoints.

MoE: qk_norm='full' <-> OlmoeForCausalLM, qk_norm='head' <-> Qwen3MoeForCausalLM.
Dense: qk_norm='head' <-> Qwen3ForCausalLM, qk_norm='none' <-> LlamaForCausalLM.
Our parameter names are HF's (experts in HF's 3-D layout), so conversion is config mapping only.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from spes.config.schema import ModelConfig
from spes.errors import HFConversionError
from spes.model.transformer import CausalLM


def _rope(theta: float) -> dict:
    return {"rope_type": "default", "rope_theta": theta}


def _hf_config(cfg: ModelConfig, arch: Optional[str] = None):
    import transformers as tf

    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                  max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_norm_eps,
                  tie_word_embeddings=cfg.tie_embeddings, rope_parameters=_rope(cfg.rope_theta),
                  attention_bias=False, hidden_act="silu", initializer_range=cfg.init_std,
                  pad_token_id=None, bos_token_id=None, eos_token_id=None)
    arch = arch or ("olmoe" if cfg.qk_norm == "full" else "qwen3_moe" if cfg.qk_norm == "head" else None) \
        if cfg.is_moe else ("qwen3" if cfg.qk_norm == "head" else "llama" if cfg.qk_norm == "none" else None)
    if cfg.is_moe and arch == "olmoe":
        if cfg.qk_norm != "full" or cfg.dim_per_head * cfg.num_heads != cfg.hidden_size:
            raise HFConversionError("OlmoeForCausalLM needs qk_norm='full' and head_dim*num_heads == hidden_size")
        return tf.OlmoeConfig(intermediate_size=cfg.intermediate_size, num_experts=cfg.num_experts,
                              num_experts_per_tok=cfg.top_k, norm_topk_prob=cfg.norm_topk_prob,
                              router_aux_loss_coef=cfg.lb_loss_coef, **common)
    if cfg.is_moe and arch == "qwen3_moe":
        if cfg.qk_norm != "head":
            raise HFConversionError("Qwen3MoeForCausalLM needs qk_norm='head'")
        return tf.Qwen3MoeConfig(moe_intermediate_size=cfg.intermediate_size, intermediate_size=cfg.intermediate_size,
                                 num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                                 norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                                 head_dim=cfg.dim_per_head, router_aux_loss_coef=cfg.lb_loss_coef,
                                 use_sliding_window=False, **common)
    if not cfg.is_moe and arch == "qwen3":
        if cfg.qk_norm != "head":
            raise HFConversionError("Qwen3ForCausalLM needs qk_norm='head'")
        return tf.Qwen3Config(intermediate_size=cfg.intermediate_size, head_dim=cfg.dim_per_head,
                              use_sliding_window=False, **common)
    if not cfg.is_moe and arch == "llama":
        if cfg.qk_norm != "none":
            raise HFConversionError("LlamaForCausalLM needs qk_norm='none'")
        return tf.LlamaConfig(intermediate_size=cfg.intermediate_size, head_dim=cfg.dim_per_head,
                              mlp_bias=False, **common)
    raise HFConversionError(f"no Hugging Face architecture for {'MoE' if cfg.is_moe else 'dense'} "
                            f"model with qk_norm={cfg.qk_norm!r} (arch={arch!r})")


def to_hf(model: CausalLM, arch: Optional[str] = None):
    """Build the equivalent `transformers` model (fp32) holding our weights."""
    import transformers as tf

    hf_cfg = _hf_config(model.cfg, arch)
    hf = tf.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    sd = model.canonical_state_dict()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (model.cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise HFConversionError(f"HF {type(hf).__name__} weights mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return hf.eval()


def export_hf(model: CausalLM, out_dir: str, tokenizer=None, arch: Optional[str] = None) -> str:
    """Write a directory `AutoModelForCausalLM.from_pretrained` loads, plus `tokenizer` (a transformers
    tokenizer, e.g. spes.data.tokenization.hf_tokenizer) if given: its EOS (and BOS/PAD where it has them)
    go into the model's config and generation config, so `generate()` stops at the end of a document."""
    hf = to_hf(model, arch)
    if tokenizer is not None:
        if getattr(tokenizer, "pad_token_id", None) is None and tokenizer.eos_token is not None:
            # no pad token: pad with EOS, as causal LMs usually do, and say so in the exported tokenizer too
            # (its pad_token_id agrees with the model's and the generation config's)
            tokenizer.pad_token = tokenizer.eos_token
        for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
            value = getattr(tokenizer, attr, None)
            setattr(hf.config, attr, value)
            if getattr(hf, "generation_config", None) is not None:
                setattr(hf.generation_config, attr, value)
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def _model_config_from_hf(hf_cfg) -> ModelConfig:
    mt = hf_cfg.model_type
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0)))
    if (rope.get("rope_type") or "default") != "default":
        raise HFConversionError(f"{mt}: rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
    if getattr(hf_cfg, "attention_bias", False) or getattr(hf_cfg, "mlp_bias", False):
        raise HFConversionError(f"{mt}: attention/MLP biases are not supported")
    if mt in ("qwen3", "qwen3_moe") and getattr(hf_cfg, "use_sliding_window", False):
        raise HFConversionError(f"{mt}: sliding-window attention is not supported")
    base = dict(vocab_size=hf_cfg.vocab_size, hidden_size=hf_cfg.hidden_size, num_layers=hf_cfg.num_hidden_layers,
                num_heads=hf_cfg.num_attention_heads,
                num_kv_heads=hf_cfg.num_key_value_heads or hf_cfg.num_attention_heads,
                head_dim=getattr(hf_cfg, "head_dim", None), rope_theta=theta, rms_norm_eps=hf_cfg.rms_norm_eps,
                max_seq_len=hf_cfg.max_position_embeddings, tie_embeddings=bool(hf_cfg.tie_word_embeddings),
                init_std=getattr(hf_cfg, "initializer_range", 0.02))
    if mt == "olmoe":
        if hf_cfg.clip_qkv is not None:
            raise HFConversionError("olmoe: clip_qkv is not supported")
        return ModelConfig(intermediate_size=hf_cfg.intermediate_size, num_experts=hf_cfg.num_experts,
                           top_k=hf_cfg.num_experts_per_tok, norm_topk_prob=hf_cfg.norm_topk_prob, qk_norm="full",
                           **base)
    if mt == "qwen3_moe":
        if hf_cfg.mlp_only_layers or hf_cfg.decoder_sparse_step != 1:
            raise HFConversionError("qwen3_moe: dense layers inside the MoE (mlp_only_layers/decoder_sparse_step) are not supported")
        return ModelConfig(intermediate_size=hf_cfg.moe_intermediate_size, num_experts=hf_cfg.num_experts,
                           top_k=hf_cfg.num_experts_per_tok, norm_topk_prob=hf_cfg.norm_topk_prob, qk_norm="head",
                           **base)
    if mt == "qwen3":
        return ModelConfig(intermediate_size=hf_cfg.intermediate_size, num_experts=0, qk_norm="head", **base)
    if mt == "llama":
        return ModelConfig(intermediate_size=hf_cfg.intermediate_size, num_experts=0, qk_norm="none", **base)
    raise HFConversionError(f"unsupported Hugging Face model_type {mt!r} (supported: olmoe, qwen3_moe, qwen3, llama)")


def load_hf(path_or_id: str) -> CausalLM:
    """Load a HF checkpoint (local dir or hub id) of a supported architecture into our model."""
    import transformers as tf

    try:
        hf_cfg = tf.AutoConfig.from_pretrained(path_or_id)
    except (OSError, ValueError) as e:
        raise HFConversionError(f"cannot read a Hugging Face config from {path_or_id!r}: {e}") from None
    cfg = _model_config_from_hf(hf_cfg)
    hf = tf.AutoModelForCausalLM.from_pretrained(path_or_id, dtype=torch.float32)
    sd = {k: v for k, v in hf.state_dict().items()}
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    model = CausalLM(cfg)
    model.load_canonical_state_dict(sd)
    return model.eval()
