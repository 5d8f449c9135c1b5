"""Expert-merging warm-up (SPES §3.3): pull each expert toward its most similar peers early in training.

Per MoE layer: cosine similarity between experts' flattened gate (w1) weights; each expert's top-k most
similar *other* experts are its donors; all of its weights become theta + alpha * mean(theta_donor - theta).
All experts are updated from the same old values (a simultaneous update).

`ExpertMerging` is the warm-up as a sync method holds it (spes/sync/methods.py: Spes): its schedule (when a
sync step merges, with which alpha) and the merge of one layer's expert tensors, the hook the aggregator
calls; it knows the tensors by their kind, so the order they come in does not matter.
"""
from __future__ import annotations

import torch

from spes.config.schema import MergeConfig
from spes.errors import ConfigError
from spes.model.names import expert_kind


def merge_alpha(step: int, alpha_start: float, decay_steps: int) -> float:
    """alpha decays linearly from alpha_start at step 0 to 0 at decay_steps."""
    return max(0.0, alpha_start * (1.0 - step / decay_steps))


def merge_due(step: int, interval: int, alpha: float) -> bool:
    return step > 0 and step % interval == 0 and alpha > 0.0


def donors_by_gate_similarity(gate_up_EID: torch.Tensor, top_k: int) -> torch.Tensor:
    """(E, top_k) donor ids: the most cosine-similar other experts by gate weights (first half of gate_up)."""
    E, twoI, _ = gate_up_EID.shape
    if not 1 <= top_k < E:
        raise ConfigError(f"merge.top_k ({top_k}) must be in [1, num_experts-1={E - 1}]")
    gate_EX = gate_up_EID[:, : twoI // 2, :].reshape(E, -1).double()
    unit = gate_EX / gate_EX.norm(dim=1, keepdim=True).clamp_min(1e-12)
    sim_EE = unit @ unit.t()
    sim_EE.fill_diagonal_(float("-inf"))  # never your own donor
    return torch.topk(sim_EE, top_k, dim=1).indices


def merge_layer(weights: dict[str, torch.Tensor], alpha: float, top_k: int) -> dict[str, torch.Tensor]:
    """weights: {'gate_up_proj': E x 2I x D, 'down_proj': E x D x I} -> merged copies."""
    donors_Ek = donors_by_gate_similarity(weights["gate_up_proj"], top_k)
    out = {}
    for name, w in weights.items():
        donor_mean = w[donors_Ek].mean(dim=1)  # (E, ...)
        out[name] = w + alpha * (donor_mean - w)
    return out


def merge_experts(state: dict[str, torch.Tensor], alpha: float, top_k: int) -> dict[str, torch.Tensor]:
    """Apply `merge_layer` to every MoE layer of a canonical state dict; returns a new dict."""
    out = dict(state)
    for name in state:
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            merged = merge_layer({"gate_up_proj": state[name], "down_proj": state[prefix + "down_proj"]}, alpha, top_k)
            out[name], out[prefix + "down_proj"] = merged["gate_up_proj"], merged["down_proj"]
    return out


class ExpertMerging:
    """The merging warm-up of merge: alpha_start decaying linearly to 0 at decay_steps, applied at sync
    steps that are multiples of interval, each expert pulled toward its top_k most similar peers."""

    def __init__(self, m: MergeConfig):
        self.enabled, self.interval, self.top_k = m.enabled, m.interval, m.top_k
        self.alpha_start, self.decay_steps = m.alpha_start, m.decay_steps

    def alpha(self, step: int, num_experts: int) -> float:
        """The alpha applied at sync `step` (0 = no merging this round)."""
        if not (self.enabled and num_experts > 0):
            return 0.0
        alpha = merge_alpha(step, self.alpha_start, self.decay_steps)
        return alpha if merge_due(step, self.interval, alpha) else 0.0

    def merge(self, layer: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
        """One layer's expert tensors {canonical name: E x ...} (gate_up_proj and down_proj) merged."""
        by_kind = {expert_kind(n): t for n, t in layer.items()}
        if sorted(by_kind) != ["down_proj", "gate_up_proj"]:
            raise ConfigError(f"merging needs a layer's gate_up_proj and down_proj, got {sorted(layer)}")
        merged = merge_layer(by_kind, alpha, self.top_k)
        return {n: merged[expert_kind(n)] for n in layer}
