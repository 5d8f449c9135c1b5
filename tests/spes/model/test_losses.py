import pytest
import torch

from spes.model.losses import decayed_lb_factor, load_balance_loss, router_z_loss


def test_losses_exact_values():
    probs = torch.full((4, 2), 0.5)
    assert load_balance_loss(probs, torch.tensor([4, 4]), top_k=2).item() == pytest.approx(1.0)
    probs = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert load_balance_loss(probs, torch.tensor([2, 0]), top_k=1).item() == pytest.approx(2.0)
    assert load_balance_loss(probs, torch.tensor([2, 0]), 1, torch.tensor([0.7, 1.0])).item() == pytest.approx(1.4)
    assert router_z_loss(torch.zeros(3, 4)).item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2)


def test_decayed_lb_factor():
    assert decayed_lb_factor(0, 100) == 0.7 and decayed_lb_factor(10, 100) == pytest.approx(0.85)
    assert decayed_lb_factor(20, 100) == 1.0 and decayed_lb_factor(90, 100) == 1.0
