"""Aggregation arithmetic, exact."""
import pytest
import torch

from spes.aggregate import NodeResult, OuterState, aggregate_diloco, aggregate_mean, aggregate_spes


def _results():
    # 2 experts of 1x1 weights per layer, shared param "w" of shape (2,)
    a = NodeResult(0, {"w": torch.tensor([1.0, 2.0]), "l.mlp.experts.gate_up_proj": torch.tensor([[[10.0]]])}, (0,), 1)
    b = NodeResult(1, {"w": torch.tensor([3.0, 6.0]), "l.mlp.experts.gate_up_proj": torch.tensor([[[20.0]]])}, (1,), 3)
    prev = {"w": torch.tensor([0.0, 0.0]), "l.mlp.experts.gate_up_proj": torch.tensor([[[-1.0]], [[-2.0]]])}
    return prev, a, b


def test_spes_aggregation_exact():
    prev, a, b = _results()
    new = aggregate_spes(prev, [a, b])
    assert new["w"].tolist() == [2.0, 4.0]
    assert new["l.mlp.experts.gate_up_proj"].flatten().tolist() == [10.0, 20.0]
    assert aggregate_spes(prev, [a, b], token_weighted=True)["w"].tolist() == [2.5, 5.0]
    only_a = aggregate_spes(prev, [a])  # node 1 missing: its expert keeps the previous value
    assert only_a["w"].tolist() == [1.0, 2.0]
    assert only_a["l.mlp.experts.gate_up_proj"].flatten().tolist() == [10.0, -2.0]
    with pytest.raises(ValueError, match="no node results"):
        aggregate_spes(prev, [])


def test_diloco_outer_nesterov_exact():
    prev = {"w": torch.tensor([1.0])}
    res = [NodeResult(0, {"w": torch.tensor([0.0])}, (), 1), NodeResult(1, {"w": torch.tensor([0.5])}, (), 1)]
    st = OuterState()
    # delta = mean(1-0, 1-0.5) = 0.75; buf = 0.75; nesterov g = 0.75 + 0.9*0.75 = 1.425; w = 1 - 0.7*1.425
    new = aggregate_diloco(prev, res, st, lr=0.7, momentum=0.9)
    assert new["w"].item() == pytest.approx(1 - 0.7 * 1.425, abs=1e-6)
    # same as torch.optim.SGD on the pseudo-gradient
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    p.grad = torch.tensor([0.75])
    opt.step()
    assert new["w"].item() == pytest.approx(p.item(), abs=1e-6)
    new2 = aggregate_diloco(new, [NodeResult(0, {"w": new["w"] - 0.1}, (), 1)], st, 0.7, 0.9)
    p.grad = torch.tensor([0.1])
    opt.step()
    assert new2["w"].item() == pytest.approx(p.item(), abs=1e-6)


def test_fedavg_mean_exact():
    prev = {"w": torch.tensor([1.0])}
    res = [NodeResult(0, {"w": torch.tensor([0.0])}, (), 1), NodeResult(1, {"w": torch.tensor([0.5])}, (), 3)]
    assert aggregate_mean(prev, res)["w"].item() == 0.25
    assert aggregate_mean(prev, res, token_weighted=True)["w"].item() == 0.375
