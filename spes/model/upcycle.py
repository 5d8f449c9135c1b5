"""Sparse upcycling: dense model -> MoE whose experts are copies of the dense MLP.

Attention, norms, embeddings and lm head are copied; every expert starts as the dense SwiGLU MLP
(optionally with Gaussian noise on a random fraction of its weights, so experts can diverge); the
router starts small and random. With zero noise and normalized top-k gates (weights summing to 1)
the MoE computes exactly the dense function, whatever the router does.
"""
from __future__ import annotations

import dataclasses

import torch

from spes.config.schema import TRAINING_FIELDS, ModelConfig
from spes.errors import UpcycleError
from spes.model.transformer import CausalLM

MOE_FIELDS = ("num_experts", "top_k", "norm_topk_prob") + TRAINING_FIELDS
"""What upcycling adds to a dense architecture (and training-only settings a checkpoint does not carry);
every other field must agree with the dense model."""


def moe_config_for(dense_cfg: ModelConfig, wanted: ModelConfig) -> ModelConfig:
    """The MoE config to upcycle `dense_cfg` into: its architecture, `wanted`'s MoE settings. Refuses a dense
    model whose architecture differs from `wanted` (params.yaml's `model` section must describe the run)."""
    if dense_cfg.is_moe:
        raise UpcycleError("upcycle: the source model is already an MoE")
    if not wanted.is_moe:
        raise UpcycleError("upcycle: model.num_experts is 0; nothing to upcycle into")
    differ = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in MOE_FIELDS
              and f.name not in ("init_std", "max_seq_len", "head_dim")
              and getattr(dense_cfg, f.name) != getattr(wanted, f.name)]
    if dense_cfg.dim_per_head != wanted.dim_per_head:
        differ.append("head_dim")
    if differ:
        raise UpcycleError("upcycle: the dense model differs from params.yaml's model section in "
                           + ", ".join(f"model.{k} (dense {getattr(dense_cfg, k)!r}, params {getattr(wanted, k)!r})" for k in differ))
    return dataclasses.replace(dense_cfg, **{k: getattr(wanted, k) for k in MOE_FIELDS},
                               max_seq_len=wanted.max_seq_len)


def upcycle(dense: CausalLM, moe_cfg: ModelConfig, noise_std: float = 0.0, noise_fraction: float = 0.5,
            router_init_std: float = 0.02, seed: int = 0) -> CausalLM:
    cfg = moe_config_for(dense.cfg, moe_cfg)
    if not 1 <= cfg.top_k <= cfg.num_experts:
        raise UpcycleError(f"upcycle: top_k ({cfg.top_k}) must be in [1, num_experts={cfg.num_experts}]")
    moe = CausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    dense_sd = dense.canonical_state_dict()
    sd: dict[str, torch.Tensor] = {}
    for name, t in dense_sd.items():
        if ".mlp." not in name:
            sd[name] = t.clone()
    E = cfg.num_experts
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp."
        gate_up_2ID = torch.cat([dense_sd[p + "gate_proj.weight"], dense_sd[p + "up_proj.weight"]])
        down_DI = dense_sd[p + "down_proj.weight"]
        gate_up = gate_up_2ID.unsqueeze(0).repeat(E, 1, 1)
        down = down_DI.unsqueeze(0).repeat(E, 1, 1)
        if noise_std > 0:
            for w in (gate_up, down):
                mask = torch.rand(w.shape, generator=gen) < noise_fraction
                w.add_(mask * torch.randn(w.shape, generator=gen) * noise_std)
        sd[p + "experts.gate_up_proj"] = gate_up
        sd[p + "experts.down_proj"] = down
        sd[p + "gate.weight"] = torch.randn(E, cfg.hidden_size, generator=gen) * router_init_std
    moe.load_canonical_state_dict(sd)
    return moe
