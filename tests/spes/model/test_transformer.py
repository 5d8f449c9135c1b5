"""The model's canonical (storage / HF) state dict."""
import pytest
import torch

from spes.errors import ModelError
from spes.model.names import canonical_shapes
from spes.model.transformer import CausalLM
from tests.conftest import tiny_config


@pytest.mark.parametrize("changes", [{}, {"qk_norm": "head"}, {"num_experts": 0, "qk_norm": "none", "tie_embeddings": True},
                                     {"head_dim": 16}])
def test_canonical_shapes_from_the_config_alone(changes):
    cfg = tiny_config(**changes)
    model = CausalLM(cfg)
    assert {k: tuple(v.shape) for k, v in model.canonical_state_dict().items()} == canonical_shapes(cfg)


def test_load_canonical_state_dict_names_what_is_wrong():
    model = CausalLM(tiny_config())
    sd = {k: v.clone() for k, v in model.canonical_state_dict().items()}
    sd.pop("lm_head.weight")
    with pytest.raises(ModelError, match="missing.*lm_head.weight"):
        model.load_canonical_state_dict(sd)
    sd = {k: v.clone() for k, v in model.canonical_state_dict().items()}
    sd["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="model.norm.weight: shape"):
        model.load_canonical_state_dict(sd)
