"""Parity with Hugging Face's reference implementations, and HF import/export."""
import os

import pytest
import torch

from spes.data.tokenization import hf_tokenizer
from spes.errors import HFConversionError
from spes.model.hf import export_hf, load_hf, to_hf
from spes.model.transformer import CausalLM
from tests.conftest import SHARED, tiny_config

OLMO_TOKENIZER = os.path.join(SHARED, "tokenizers", "gpt-neox-olmo-dolma-v1_5.json")


def _randomize_norms(model):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.normal_(1.0, 0.2)


@pytest.mark.parametrize("qk_norm,arch", [("full", "OlmoeForCausalLM"), ("head", "Qwen3MoeForCausalLM")])
@pytest.mark.parametrize("norm_topk", [False, True])
def test_moe_logits_match_hf(tmp_path, qk_norm, arch, norm_topk):
    import transformers

    torch.manual_seed(0)
    model = CausalLM(tiny_config(qk_norm=qk_norm, norm_topk_prob=norm_topk)).eval()
    _randomize_norms(model)
    export_hf(model, str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(hf).__name__ == arch
    x = torch.randint(0, 96, (3, 17))
    with torch.no_grad():
        assert (hf(x).logits - model(x).logits).abs().max().item() < 1e-4
    back = load_hf(str(tmp_path / "hf"))
    with torch.no_grad():
        assert torch.equal(back(x).logits, model(x).logits)


@pytest.mark.skipif(not os.path.exists(OLMO_TOKENIZER), reason="shared tokenizer not present")
def test_export_with_tokenizer_loads_as_olmoe(tmp_path):
    import transformers

    model = CausalLM(tiny_config(vocab_size=50304, qk_norm="full"))
    export_hf(model, str(tmp_path / "hf"), hf_tokenizer(OLMO_TOKENIZER))
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))("def f(x):")["input_ids"]
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "hf")).model_type == "olmoe"


@pytest.mark.parametrize("qk_norm,model_type", [("head", "qwen3"), ("none", "llama")])
def test_dense_import_from_hf_save_pretrained(tmp_path, qk_norm, model_type):
    import transformers

    torch.manual_seed(1)
    ours = CausalLM(tiny_config(num_experts=0, qk_norm=qk_norm, tie_embeddings=True)).eval()
    _randomize_norms(ours)
    hf = to_hf(ours)
    hf.save_pretrained(str(tmp_path / "d"))
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "d")).model_type == model_type
    loaded = load_hf(str(tmp_path / "d"))
    x = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        assert (loaded(x).logits - hf(x).logits).abs().max().item() < 1e-4


def test_unsupported_checkpoints_are_refused_clearly(tmp_path):
    with pytest.raises(HFConversionError, match="cannot read a Hugging Face config"):
        load_hf(str(tmp_path / "nothing-here"))
    with pytest.raises(HFConversionError, match="no Hugging Face architecture"):
        to_hf(CausalLM(tiny_config(num_experts=0, qk_norm="full")))


def test_the_export_stops_generating_at_the_tokenizers_eos(tmp_path, tiny_tokens):
    """The exported config carries the tokenizer's EOS (and pads with it), so generate() ends a document."""
    import transformers

    tok = hf_tokenizer(os.path.join(tiny_tokens, "tokenizer.json"))
    model = CausalLM(tiny_config(vocab_size=512, qk_norm="full"))
    with torch.no_grad():  # every logit equal: greedy decoding picks id 0, the BPE's EOS
        model.lm_head.weight.zero_()
    assert tok.eos_token_id == 0
    export_hf(model, str(tmp_path / "hf"), tok)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert hf.config.eos_token_id == hf.generation_config.eos_token_id == tok.eos_token_id
    saved = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert saved.pad_token_id == hf.config.pad_token_id == hf.generation_config.pad_token_id == 0  # pads with EOS
    x = torch.tensor([[5, 6, 7]])
    out = hf.generate(x, max_new_tokens=20, do_sample=False)
    assert out.shape[1] == 4 and out[0, -1].item() == tok.eos_token_id  # stopped at EOS, not after 20
