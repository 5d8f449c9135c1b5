"""Sparse upcycling: exact dense function at zero noise; noise where and as much as asked."""
import pytest
import torch

from spes.errors import UpcycleError
from spes.model.transformer import CausalLM
from spes.model.upcycle import upcycle
from tests.conftest import tiny_config


@pytest.mark.parametrize("qk_norm", ["head", "none"])
def test_upcycled_zero_noise_equals_dense(qk_norm):
    torch.manual_seed(2)
    dense = CausalLM(tiny_config(num_experts=0, qk_norm=qk_norm)).eval()
    moe = upcycle(dense, tiny_config(num_experts=8, top_k=2, norm_topk_prob=True, qk_norm=qk_norm),
                  noise_std=0.0, router_init_std=0.5).eval()
    x = torch.randint(0, 96, (2, 13))
    with torch.no_grad():
        assert (moe(x).logits - dense(x).logits).abs().max().item() < 1e-4


def test_upcycle_noise_fraction_and_std_on_both_expert_matrices():
    torch.manual_seed(3)
    wide = dict(hidden_size=64, intermediate_size=128)  # enough weights for tight statistics
    dense = CausalLM(tiny_config(num_experts=0, **wide))
    moe = upcycle(dense, tiny_config(**wide), noise_std=0.02, noise_fraction=0.5, seed=3)
    sd, dsd = moe.canonical_state_dict(), dense.canonical_state_dict()
    for layer in range(2):
        p = f"model.layers.{layer}.mlp."
        gate_up = torch.cat([dsd[p + "gate_proj.weight"], dsd[p + "up_proj.weight"]])
        for name, ref in (("gate_up_proj", gate_up), ("down_proj", dsd[p + "down_proj.weight"])):
            noise = sd[p + f"experts.{name}"] - ref.unsqueeze(0)
            touched = noise != 0
            assert 0.48 < touched.float().mean().item() < 0.52, name
            assert noise[touched].std().item() == pytest.approx(0.02, rel=0.05), name
            assert noise[touched].mean().abs().item() < 0.002, name
            assert not torch.equal(noise[0], noise[1])  # each expert gets its own noise


def test_upcycle_keeps_the_dense_architecture_and_refuses_mismatches():
    dense = CausalLM(tiny_config(num_experts=0, lb_loss_coef=0.5))
    moe = upcycle(dense, tiny_config(lb_loss_coef=0.02, z_loss_coef=0.0, top_k=1))
    assert (moe.cfg.num_experts, moe.cfg.top_k, moe.cfg.lb_loss_coef, moe.cfg.z_loss_coef) == (4, 1, 0.02, 0.0)
    with pytest.raises(UpcycleError, match=r"model.hidden_size \(dense 32, params 64\)"):
        upcycle(dense, tiny_config(hidden_size=64))
    with pytest.raises(UpcycleError, match="already an MoE"):
        upcycle(CausalLM(tiny_config()), tiny_config())
