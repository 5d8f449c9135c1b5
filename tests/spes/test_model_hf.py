import pytest
import torch

from spes.config import ModelConfig
from spes.hf import export_hf, load_hf, to_hf
from spes.model import CausalLM
from spes.upcycle import upcycle


def _randomize_norms(model):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.normal_(1.0, 0.2)


def tiny(**kw):
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                num_experts=4, top_k=2, max_seq_len=64)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("qk_norm,arch", [("full", "OlmoeForCausalLM"), ("head", "Qwen3MoeForCausalLM")])
@pytest.mark.parametrize("norm_topk", [False, True])
def test_moe_logits_match_hf(tmp_path, qk_norm, arch, norm_topk):
    torch.manual_seed(0)
    model = CausalLM(tiny(qk_norm=qk_norm, norm_topk_prob=norm_topk)).eval()
    _randomize_norms(model)
    export_hf(model, str(tmp_path / "hf"))
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(hf).__name__ == arch
    x = torch.randint(0, 96, (3, 17))
    with torch.no_grad():
        assert (hf(x).logits - model(x).logits).abs().max().item() < 1e-4
    back = load_hf(str(tmp_path / "hf"))
    with torch.no_grad():
        assert torch.equal(back(x).logits, model(x).logits)


def test_export_with_tokenizer_loads_as_olmoe(tmp_path):
    import os

    import transformers

    tok = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "tokenizers", "gpt-neox-olmo-dolma-v1_5.json")
    if not os.path.exists(tok):
        pytest.skip("shared tokenizer not present")
    model = CausalLM(tiny(vocab_size=50304, qk_norm="full"))
    export_hf(model, str(tmp_path / "hf"), tok)
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))("def f(x):")["input_ids"]
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "hf")).model_type == "olmoe"


@pytest.mark.parametrize("qk_norm,model_type", [("head", "qwen3"), ("none", "llama")])
def test_dense_import_from_hf_save_pretrained(tmp_path, qk_norm, model_type):
    import transformers

    torch.manual_seed(1)
    ours = CausalLM(tiny(num_experts=0, qk_norm=qk_norm, tie_embeddings=True)).eval()
    _randomize_norms(ours)
    hf = to_hf(ours)
    hf.save_pretrained(str(tmp_path / "d"))
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "d")).model_type == model_type
    loaded = load_hf(str(tmp_path / "d"))
    x = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        assert (loaded(x).logits - hf(x).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("qk_norm", ["head", "none"])
def test_upcycled_zero_noise_equals_dense(qk_norm):
    torch.manual_seed(2)
    dense = CausalLM(tiny(num_experts=0, qk_norm=qk_norm)).eval()
    moe = upcycle(dense, num_experts=8, top_k=2, norm_topk_prob=True, noise_std=0.0, router_init_std=0.5).eval()
    x = torch.randint(0, 96, (2, 13))
    with torch.no_grad():
        assert (moe(x).logits - dense(x).logits).abs().max().item() < 1e-4


def test_upcycle_noise_touches_the_requested_fraction():
    dense = CausalLM(tiny(num_experts=0))
    moe = upcycle(dense, 4, 2, noise_std=0.02, noise_fraction=0.5, seed=3)
    gu = moe.canonical_state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    ref = torch.cat([dense.canonical_state_dict()[f"model.layers.0.mlp.{n}.weight"] for n in ("gate_proj", "up_proj")])
    changed = (gu != ref.unsqueeze(0)).float().mean().item()
    assert 0.45 < changed < 0.55


def test_chunked_experts_compute_the_same_function():
    torch.manual_seed(4)
    model = CausalLM(tiny()).eval()
    x = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        ref = model(x).logits
        model.set_trainable_experts([1, 3])
        assert len(model.moe_layers()[0].experts.chunks) == 4
        assert torch.allclose(model(x).logits, ref, atol=1e-6)


def test_grouped_and_loop_expert_paths_agree():
    from spes import moe as moe_mod

    torch.manual_seed(5)
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(3, 12, 8, requires_grad=True)
    counts = torch.tensor([4, 0, 6])
    y = moe_mod.grouped_linear(x, w, counts)
    ref = torch.cat([x[:4] @ w[0].t(), x[4:] @ w[2].t()])
    assert torch.allclose(y, ref, atol=1e-5)
    y.sum().backward()  # stride-0 gradient must be accepted
    assert w.grad[1].abs().sum().item() == 0.0


def test_losses_exact_values():
    from spes.losses import decayed_lb_factor, load_balance_loss, router_z_loss

    probs = torch.full((4, 2), 0.5)
    assert load_balance_loss(probs, torch.tensor([4, 4]), top_k=2).item() == pytest.approx(1.0)
    probs = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert load_balance_loss(probs, torch.tensor([2, 0]), top_k=1).item() == pytest.approx(2.0)
    assert load_balance_loss(probs, torch.tensor([2, 0]), 1, torch.tensor([0.7, 1.0])).item() == pytest.approx(1.4)
    assert router_z_loss(torch.zeros(3, 4)).item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2)
    assert decayed_lb_factor(0, 100) == 0.7 and decayed_lb_factor(10, 100) == pytest.approx(0.85)
    assert decayed_lb_factor(20, 100) == 1.0 and decayed_lb_factor(90, 100) == 1.0
