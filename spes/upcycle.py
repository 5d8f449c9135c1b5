"""Sparse upcycling: dense model -> MoE whose experts are copies of the dense MLP.

Attention, norms, embeddings and lm head are copied; every expert starts as the dense SwiGLU MLP
(optionally with Gaussian noise on a random fraction of its weights, so experts can diverge); the
router starts small and random. With zero noise and normalized top-k gates (weights summing to 1)
the MoE computes exactly the dense function, whatever the router does.
"""
from __future__ import annotations

import dataclasses

import torch

from spes.model import CausalLM


def upcycle(dense: CausalLM, num_experts: int, top_k: int, norm_topk_prob: bool = True,
            noise_std: float = 0.0, noise_fraction: float = 0.5, router_init_std: float = 0.02,
            seed: int = 0) -> CausalLM:
    if dense.cfg.is_moe:
        raise ValueError("upcycle: the source model is already an MoE")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"upcycle: top_k ({top_k}) must be in [1, num_experts={num_experts}]")
    cfg = dataclasses.replace(dense.cfg, num_experts=num_experts, top_k=top_k, norm_topk_prob=norm_topk_prob)
    moe = CausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    dense_sd = dense.canonical_state_dict()
    sd: dict[str, torch.Tensor] = {}
    for name, t in dense_sd.items():
        if ".mlp." not in name:
            sd[name] = t.clone()
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp."
        gate_up_2ID = torch.cat([dense_sd[p + "gate_proj.weight"], dense_sd[p + "up_proj.weight"]])
        down_DI = dense_sd[p + "down_proj.weight"]
        gate_up = gate_up_2ID.unsqueeze(0).repeat(num_experts, 1, 1)
        down = down_DI.unsqueeze(0).repeat(num_experts, 1, 1)
        if noise_std > 0:
            for w in (gate_up, down):
                mask = torch.rand(w.shape, generator=gen) < noise_fraction
                w.add_(mask * torch.randn(w.shape, generator=gen) * noise_std)
        sd[p + "experts.gate_up_proj"] = gate_up
        sd[p + "experts.down_proj"] = down
        sd[p + "gate.weight"] = torch.randn(num_experts, cfg.hidden_size, generator=gen) * router_init_std
    moe.load_canonical_state_dict(sd)
    return moe
