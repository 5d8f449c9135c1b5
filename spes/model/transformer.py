"""Decoder-only transformer of the OLMoE family (MoE) and its dense counterpart, single device.

Pre-norm blocks: x + attn(rmsnorm(x)), x + mlp(rmsnorm(x)); RoPE; optional q/k RMSNorm ('full' over all
heads as in OLMoE, 'head' per head as in Qwen3); SwiGLU MLP or MoE. Parameter names follow Hugging Face
(`model.layers.N.self_attn.q_proj.weight`, ...), so HF import/export is a rename of the experts at most.
Shapes: B batch, S sequence, D hidden, H heads, Hkv kv heads, hd head dim, V vocab, L layers, E experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from spes.config.schema import ModelConfig
from spes.errors import ConfigError, ModelError
from spes.model.losses import chunked_linear_cross_entropy, grouped_load_balance_loss, load_balance_loss, router_z_loss
from spes.model.moe import MoE
from spes.model.names import canonical_shapes, expert_tensor, is_chunk_param


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs_SH = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs_SH, freqs_SH), dim=-1)  # (S, hd), HF's rotate-half convention
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_BHSd: torch.Tensor, cos_Sd: torch.Tensor, sin_Sd: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BHSd.chunk(2, dim=-1)
    return x_BHSd * cos_Sd + torch.cat((-x2, x1), dim=-1) * sin_Sd


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, H, Hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head
        self.H, self.Hkv, self.hd, self.qk_norm = H, Hkv, hd, cfg.qk_norm
        self.q_proj = nn.Linear(D, H * hd, bias=False)
        self.k_proj = nn.Linear(D, Hkv * hd, bias=False)
        self.v_proj = nn.Linear(D, Hkv * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, D, bias=False)
        if cfg.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(H * hd, cfg.rms_norm_eps), RMSNorm(Hkv * hd, cfg.rms_norm_eps)
        elif cfg.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.rms_norm_eps), RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q, k, v = self.q_proj(x_BSD), self.k_proj(x_BSD), self.v_proj(x_BSD)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, self.H, self.hd)
        k = k.view(B, S, self.Hkv, self.hd)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q_BHSd = apply_rope(q.transpose(1, 2), cos, sin)
        k_BHSd = apply_rope(k.transpose(1, 2), cos, sin)
        v_BHSd = v.view(B, S, self.Hkv, self.hd).transpose(1, 2)
        if self.Hkv != self.H:  # GQA: each kv head serves H/Hkv consecutive query heads (HF repeat_kv)
            k_BHSd = k_BHSd.repeat_interleave(self.H // self.Hkv, dim=1)
            v_BHSd = v_BHSd.repeat_interleave(self.H // self.Hkv, dim=1)
        y = F.scaled_dot_product_attention(q_BHSd, k_BHSd, v_BHSd, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, self.H * self.hd))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe:
            self.mlp: nn.Module = MoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k,
                                      cfg.norm_topk_prob, cfg.init_std, cfg.experts_impl)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            y, router = self.mlp(h)
            return x + y, router
        return x + self.mlp(h), None


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class ModelOutput:
    logits: Optional[torch.Tensor]  # None when the loss was computed chunked (model.loss_impl: chunked)
    loss: Optional[torch.Tensor] = None  # ce + lb_coef * lb + z_coef * z (+ lm-head z-loss)
    ce: Optional[torch.Tensor] = None
    lb: Optional[torch.Tensor] = None
    z: Optional[torch.Tensor] = None
    expert_counts_LE: Optional[torch.Tensor] = None


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def _init_weights(self) -> None:
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=self.cfg.init_std)

    activation_checkpointing = False
    """Recompute each block's activations in the backward pass instead of keeping them (set by the trainer)."""

    def forward(self, input_ids_BS: torch.Tensor, labels_BS: Optional[torch.Tensor] = None,
                lb_expert_weight_E: Optional[torch.Tensor] = None, lb_groups: int = 1) -> ModelOutput:
        """`lb_groups`: the load-balance loss is the mean of that of `lb_groups` equal groups of sequences
        (the micro-batches a batch would be split into; see spes.model.losses.grouped_load_balance_loss)."""
        B, S = input_ids_BS.shape
        x = self.model.embed_tokens(input_ids_BS)
        cos, sin = rope_cos_sin(S, self.cfg.dim_per_head, self.cfg.rope_theta, x.device, x.dtype)
        routers = []
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for layer in self.model.layers:
            if recompute:  # non-reentrant: keeps the router outputs, recomputes bitwise-equal activations
                x, r = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x, r = layer(x, cos, sin)
            if r is not None:
                routers.append(r)
        h = self.model.norm(x)
        if labels_BS is not None and self.cfg.loss_impl == "chunked":  # the loss without the B x S x V logits
            out = ModelOutput(logits=None)
            out.ce, z_head = chunked_linear_cross_entropy(h.reshape(B * S, -1), self.lm_head.weight,
                                                          labels_BS.reshape(-1), self.cfg.loss_chunk_tokens)
            out.loss = out.ce
            if self.cfg.lm_head_z_loss_coef > 0:
                out.loss = out.loss + self.cfg.lm_head_z_loss_coef * z_head
        else:
            logits = self.lm_head(h)
            out = ModelOutput(logits=logits)
            if labels_BS is not None:
                logits32 = logits.float()
                out.ce = F.cross_entropy(logits32.reshape(-1, logits.shape[-1]), labels_BS.reshape(-1))
                out.loss = out.ce
                if self.cfg.lm_head_z_loss_coef > 0:  # keeps the output logits from drifting (reference: 1e-5)
                    out.loss = out.loss + self.cfg.lm_head_z_loss_coef * torch.logsumexp(logits32, dim=-1).square().mean()
        if routers:
            out.expert_counts_LE = torch.stack([r.counts_E for r in routers]).detach()
        if labels_BS is None:
            return out
        if routers:
            k = self.cfg.top_k
            if B % lb_groups:
                raise ConfigError(f"{B} sequences do not split into {lb_groups} load-balance groups")
            out.lb = torch.stack([load_balance_loss(r.probs_TE, r.counts_E, k, lb_expert_weight_E) if lb_groups == 1
                                  else grouped_load_balance_loss(r.probs_TE, r.top_idx_TK, lb_groups, k,
                                                                 lb_expert_weight_E)
                                  for r in routers]).mean()
            z_L = torch.stack([router_z_loss(r.logits_TE) for r in routers])
            out.z = z_L.sum() if self.cfg.z_loss_reduction == "sum" else z_L.mean()
            assert out.loss is not None  # labels were given
            out.loss = out.loss + self.cfg.lb_loss_coef * out.lb + self.cfg.z_loss_coef * out.z
        return out

    # -- experts by ownership -------------------------------------------------------------------
    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def set_trainable_experts(self, owned, frozen_dtype: torch.dtype = torch.float32, group_of=None) -> None:
        for moe in self.moe_layers():
            moe.experts.set_trainable(owned, frozen_dtype, group_of)

    # -- canonical (chunk-free) weights: the format on storage and for HF export ---------------------
    def canonical_state_dict(self) -> dict[str, torch.Tensor]:
        sd: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters():
            if not is_chunk_param(name):
                sd[name] = p.detach()
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, MoE):
                gate_up, down = layer.mlp.experts.full_weights()
                sd[expert_tensor(i, "gate_up_proj")], sd[expert_tensor(i, "down_proj")] = gate_up, down
        if self.cfg.tie_embeddings:
            sd.pop("lm_head.weight", None)
        return sd

    @torch.no_grad()
    def load_canonical_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        check_canonical_state_dict(self.cfg, sd)
        params = dict(self.named_parameters())
        for name, t in sd.items():
            if name in params:
                params[name].copy_(t)
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, MoE):
                layer.mlp.experts.load_full(sd[expert_tensor(i, "gate_up_proj")], sd[expert_tensor(i, "down_proj")])


def check_canonical_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> None:
    """Exactly the model's canonical tensors, each of its shape."""
    expected = canonical_shapes(cfg)
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise ModelError(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, shape in expected.items():
        if tuple(sd[name].shape) != shape:
            raise ModelError(f"{name}: shape {tuple(sd[name].shape)} != model's {shape}")
