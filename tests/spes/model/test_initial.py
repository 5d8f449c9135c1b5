"""The init recipe: one way to make round 0's model (the upcycle stage and comparison variants share it), and
a record that says which recipe made an initial model, so a study with other init settings is not handed the
main pipeline's model."""
import dataclasses

import torch

from spes.config.schema import InitConfig
from spes.model.hf import export_hf
from spes.model.initial import init_record, init_source, initial_model, made_by
from spes.model.transformer import CausalLM
from spes.model.upcycle import upcycle
from tests.conftest import tiny_config


def test_upcycled_as_by_hand_and_from_scratch_with_the_router_std(tmp_path):
    torch.manual_seed(5)
    dense = CausalLM(tiny_config(num_experts=0, qk_norm="head"))
    export_hf(dense, str(tmp_path / "dense" / "hf"))
    init = InitConfig(noise_std=0.01, router_init_std=0.3, seed=7)
    model, src = initial_model(tiny_config(num_experts=8, qk_norm="head"), init, str(tmp_path))
    assert src is not None and init_source(init, str(tmp_path)) == str(tmp_path / "dense" / "hf")
    torch.manual_seed(7)
    by_hand = upcycle(src, tiny_config(num_experts=8, qk_norm="head"), 0.01, 0.5, 0.3, 7)
    got, want = model.canonical_state_dict(), by_hand.canonical_state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    scratch, none = initial_model(tiny_config(num_experts=8), dataclasses.replace(init, mode="scratch"), str(tmp_path))
    gates = torch.cat([m.gate.weight.flatten() for m in scratch.moe_layers()])
    assert none is None and 0.25 < gates.std().item() < 0.35
    zero, _ = initial_model(tiny_config(), InitConfig(mode="scratch", router_init_std=0.0), str(tmp_path))
    assert all(not m.gate.weight.any() for m in zero.moe_layers())


def test_made_by_names_the_recipe_and_the_expert_count():
    cfg, init = tiny_config(num_experts=8), InitConfig()
    record = init_record(CausalLM(cfg), init, "artifacts/dense/hf")
    assert made_by(record, cfg, init, "artifacts/dense/hf")
    assert not made_by(record, tiny_config(num_experts=4), init, "artifacts/dense/hf")  # another expert count
    scratch = dataclasses.replace(init, mode="scratch")
    assert not made_by(record, cfg, scratch, init_source(scratch, "artifacts"))  # a study from scratch
    assert not made_by(record, cfg, dataclasses.replace(init, noise_std=0.02), "artifacts/dense/hf")
    older = {k: v for k, v in record.items() if k != "init"}  # written before records named the settings
    assert made_by(older, cfg, init, "artifacts/dense/hf") and not made_by({}, cfg, init, "artifacts/dense/hf")
