"""Aggregation arithmetic per tensor, exact."""
import pytest
import torch

from spes.sync.methods import global_change, node_weights, outer_step, weighted_sum


def test_weights_and_mean():
    assert node_weights([1, 3], False) == [0.5, 0.5] and node_weights([1, 3], True) == [0.25, 0.75]
    with pytest.raises(ValueError, match="no node results"):
        node_weights([], False)
    d = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])]
    assert weighted_sum(d, [0.5, 0.5]).tolist() == [2.0, 4.0]
    assert weighted_sum(d, [0.25, 0.75]).tolist() == [2.5, 5.0]
    change, buf = global_change("spes", d, [0.5, 0.5])
    assert change.tolist() == [2.0, 4.0] and buf is None
    assert global_change("fedavg", d, [0.25, 0.75])[0].tolist() == [2.5, 5.0]


def test_diloco_outer_nesterov_is_torch_sgd():
    # nodes moved w=1 to 0 and 0.5: deltas -1, -0.5; pseudo-gradient 0.75; nesterov g = 0.75 + 0.9*0.75 = 1.425
    change, buf = global_change("diloco", [torch.tensor([-1.0]), torch.tensor([-0.5])], [0.5, 0.5],
                                outer_lr=0.7, outer_momentum=0.9)
    assert change.item() == pytest.approx(-0.7 * 1.425, abs=1e-6) and buf.item() == 0.75
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    p.grad = torch.tensor([0.75])
    opt.step()
    w = 1.0 + change.item()
    assert w == pytest.approx(p.item(), abs=1e-6)
    change2, buf2 = outer_step(torch.tensor([-0.1]), buf, 0.7, 0.9, True)
    p.grad = torch.tensor([0.1])
    opt.step()
    assert w + change2.item() == pytest.approx(p.item(), abs=1e-6)
    assert buf2.item() == pytest.approx(0.9 * 0.75 + 0.1)
    assert outer_step(torch.tensor([-0.1]), None, 0.5, 0.0, True) == (pytest.approx(torch.tensor([-0.05])), None)
