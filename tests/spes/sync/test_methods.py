"""The sync methods: who trains what, what is averaged, the aggregation arithmetic (exact), merging."""
import pytest
import torch

from spes.config.schema import SpesConfig
from spes.errors import ConfigError
from spes.sync.methods import Centralized, DiLoCo, FedAvg, Spes, node_weights, outer_step, sync_method, weighted_sum


def method(name, **kw):
    return sync_method(SpesConfig(method=name, num_nodes=2, **kw))


def global_change(name, deltas, weights, buf=None, **outer):
    kw = {k.removeprefix("outer_"): v for k, v in outer.items()}
    return method(name, **{f"outer_{k}": v for k, v in kw.items()}).global_change(deltas, weights, buf)


def test_each_method_is_an_object_with_its_own_rules():
    assert [type(method(n)) for n in ("spes", "fedavg", "centralized", "diloco")] == [Spes, FedAvg, Centralized, DiLoCo]
    with pytest.raises(ConfigError, match="spes.method must be one of"):
        method("gossip")
    spes, central = method("spes", batch_size=8), method("centralized", batch_size=8)
    assert (spes.nodes, spes.node_batch_size, central.nodes, central.node_batch_size) == (2, 8, 1, 16)
    assert spes.owned(1, 4) == (2, 3) and method("fedavg").owned(1, 4) == (0, 1, 2, 3)
    expert, shared = "model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.gate.weight"
    assert (spes.is_averaged(expert), spes.is_averaged(shared), method("fedavg").is_averaged(expert)) == (False, True, True)
    assert spes.sparse_experts and not method("diloco").sparse_experts
    assert method("diloco").keeps_outer_state and not method("diloco", outer_momentum=0.0).keeps_outer_state
    assert not spes.keeps_outer_state and method("spes", shared_outer="nesterov").keeps_outer_state


def test_spes_outer_step_on_the_shared_parameters_is_dilocos():
    d, w = [torch.tensor([-1.0]), torch.tensor([-0.5])], [0.5, 0.5]
    nesterov = method("spes", shared_outer="nesterov").global_change(d, w, None)
    assert [x.tolist() for x in nesterov] == [x.tolist() for x in method("diloco").global_change(d, w, None)]
    assert method("spes").global_change(d, w, None)[0].tolist() == [-0.75]  # the paper's mean


def test_merging_only_for_spes_when_due():
    s = method("spes")  # params.yaml's merge settings: interval 50, alpha 0.05 decaying to 0 at step 200
    assert s.merge_alpha(50, 8) == pytest.approx(0.05 * (1 - 50 / 200)) and s.merge_alpha(60, 8) == 0.0
    assert s.merge_alpha(200, 8) == 0.0 and s.merge_alpha(0, 8) == 0.0 and s.merge_alpha(50, 0) == 0.0
    assert method("fedavg").merge_alpha(50, 8) == 0.0
    s.s.merge.enabled = False
    assert s.merge_alpha(50, 8) == 0.0


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
