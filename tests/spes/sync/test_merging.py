"""Expert-merging warm-up arithmetic, exact."""
import pytest
import torch

from spes.sync.merging import donors_by_gate_similarity, merge_alpha, merge_due, merge_experts, merge_layer


def test_alpha_schedule():
    assert merge_alpha(0, 0.05, 200) == 0.05 and merge_alpha(100, 0.05, 200) == 0.025
    assert merge_alpha(300, 0.05, 200) == 0.0
    assert merge_due(100, 50, 0.02) and not merge_due(75, 50, 0.02) and not merge_due(200, 50, 0.0)
    assert not merge_due(0, 50, 0.05)  # never at step 0


def _layer():
    # 3 experts, I=1, D=2: gate rows e0=[1,0], e1=[1,0.1], e2=[0,1]
    gate_up = torch.tensor([[[1.0, 0.0], [5.0, 5.0]], [[1.0, 0.1], [1.0, 1.0]], [[0.0, 1.0], [3.0, 3.0]]])
    down = torch.tensor([[[2.0], [0.0]], [[4.0], [0.0]], [[8.0], [0.0]]])
    return gate_up, down


def test_donors_and_merge_exact():
    gate_up, down = _layer()
    assert donors_by_gate_similarity(gate_up, 1).flatten().tolist() == [1, 0, 1]
    out = merge_layer({"gate_up_proj": gate_up, "down_proj": down}, alpha=0.5, top_k=1)
    # theta + 0.5 * (donor - theta)
    assert out["down_proj"][:, 0, 0].tolist() == [3.0, 3.0, 6.0]
    assert out["gate_up_proj"][0, 1].tolist() == [3.0, 3.0]
    out2 = merge_layer({"gate_up_proj": gate_up, "down_proj": down}, alpha=1.0, top_k=2)
    assert out2["down_proj"][:, 0, 0].tolist() == [6.0, 5.0, 3.0]
    with pytest.raises(ValueError, match="top_k"):
        donors_by_gate_similarity(gate_up, 3)


def test_merge_experts_touches_every_moe_layer_and_nothing_else():
    gate_up, down = _layer()
    state = {"a.mlp.experts.gate_up_proj": gate_up, "a.mlp.experts.down_proj": down,
             "b.mlp.experts.gate_up_proj": gate_up.clone(), "b.mlp.experts.down_proj": down.clone(),
             "a.mlp.gate.weight": torch.ones(3, 2)}
    out = merge_experts(state, 0.5, 1)
    for layer in "ab":
        assert out[f"{layer}.mlp.experts.down_proj"][:, 0, 0].tolist() == [3.0, 3.0, 6.0]
    assert out["a.mlp.gate.weight"] is state["a.mlp.gate.weight"]
    assert state["a.mlp.experts.down_proj"][:, 0, 0].tolist() == [2.0, 4.0, 8.0]  # inputs untouched
