"""The sync methods: who trains what, what is averaged, the aggregation arithmetic (exact), merging."""
import pytest
import torch

from spes.config.schema import CODECS, METHODS, Params
from spes.errors import AggregationError, ConfigError
from spes.sync.codecs import CODEC_CLASSES, FP32, Codec
from spes.sync.fedadam import FedAdam, OuterAdam
from spes.sync.method import FullModelMethod, SyncMethod, node_weights, weighted_sum
from spes.sync.methods import METHODS as REGISTRY
from spes.sync.methods import Centralized, DiLoCo, FedAvg, Spes, sync_method
from spes.sync.outer import OuterSGD
from tests.conftest import params_of


def method(name, *overrides):
    return sync_method(params_of(f"sync.method={name}", "sync.num_nodes=2", *overrides))


def global_change(name, deltas, weights, state=None, *overrides):
    return method(name, *overrides).global_change("w", deltas, weights, state or {})


def test_each_method_is_an_object_with_its_own_rules():
    assert [type(method(n)) for n in ("spes", "fedavg", "centralized", "diloco", "fedadam")] == \
        [Spes, FedAvg, Centralized, DiLoCo, FedAdam]
    with pytest.raises(ConfigError, match="sync.method must be one of"):
        method("gossip")
    spes, central = method("spes", "train.batch_size=8"), method("centralized", "train.batch_size=8")
    assert (spes.nodes, spes.node_batch_size, central.nodes, central.node_batch_size) == (2, 8, 1, 16)
    assert spes.owned(1, 4) == (2, 3) and method("fedavg").owned(1, 4) == (0, 1, 2, 3)
    expert, shared = "model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.gate.weight"
    assert (spes.is_averaged(expert), spes.is_averaged(shared), method("fedavg").is_averaged(expert)) == (False, True, True)
    assert spes.sparse_experts and not method("diloco").sparse_experts
    specs = lambda m: [k for k, _, _ in m.outer_state_specs("w", (3,))]  # noqa: E731
    assert specs(method("diloco")) == ["w"] and specs(method("diloco", "outer.momentum=0.0")) == []
    assert specs(spes) == [] and specs(method("spes", "outer.shared=nesterov")) == ["w"]
    assert specs(method("fedadam")) == ["w#exp_avg", "w#exp_avg_sq", "w#step"]  # sorted: stays adjacent in files
    with pytest.raises(AggregationError, match="does not merge"):
        method("fedavg").merge({}, 0.1)


def test_the_interfaces_are_abstract_and_each_registry_is_the_schemas_list():
    for abstract in (SyncMethod, FullModelMethod, Codec):
        with pytest.raises(TypeError, match="abstract"):
            abstract(Params()) if abstract is not Codec else abstract()
    assert sorted(REGISTRY) == sorted(METHODS) and sorted(CODEC_CLASSES) == sorted(CODECS)
    assert type(CODEC_CLASSES["fp32"].build(256)) is FP32


def test_spes_outer_step_on_the_shared_parameters_is_dilocos():
    d, w = [torch.tensor([-1.0]), torch.tensor([-0.5])], [0.5, 0.5]
    nesterov = global_change("spes", d, w, None, "outer.shared=nesterov")
    diloco = global_change("diloco", d, w)
    assert nesterov[0].tolist() == diloco[0].tolist() and nesterov[1]["w"].tolist() == diloco[1]["w"].tolist()
    assert global_change("spes", d, w)[0].tolist() == [-0.75]  # the paper's mean


def test_merging_only_for_spes_when_due():
    s = method("spes")  # params.yaml's merge settings: interval 50, alpha 0.05 decaying to 0 at step 200
    assert s.merge_alpha(50, 8) == pytest.approx(0.05 * (1 - 50 / 200)) and s.merge_alpha(60, 8) == 0.0
    assert s.merge_alpha(200, 8) == 0.0 and s.merge_alpha(0, 8) == 0.0 and s.merge_alpha(50, 0) == 0.0
    assert method("fedavg").merge_alpha(50, 8) == 0.0
    assert method("spes", "merge.enabled=false").merge_alpha(50, 8) == 0.0


def test_the_merge_hook_takes_a_layers_tensors_in_any_order():
    torch.manual_seed(0)
    g, d = torch.randn(6, 6, 3), torch.randn(6, 3, 3)
    gu, dp = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"
    s = method("spes")
    a, b = s.merge({gu: g, dp: d}, 0.5), s.merge({dp: d, gu: g}, 0.5)
    assert torch.equal(a[gu], b[gu]) and torch.equal(a[dp], b[dp]) and not torch.equal(a[gu], g)
    with pytest.raises(ConfigError, match="gate_up_proj and down_proj"):
        s.merge({gu: g}, 0.5)
    with pytest.raises(ConfigError, match=r"merge.top_k \(4\)"):  # 4 experts, top_k 4: named, not a bare ValueError
        s.merge({gu: g[:4], dp: d[:4]}, 0.5)


def test_weights_and_mean():
    assert node_weights([1, 3], False) == [0.5, 0.5] and node_weights([1, 3], True) == [0.25, 0.75]
    with pytest.raises(AggregationError, match="no node results"):
        node_weights([], False)
    d = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])]
    assert weighted_sum(d, [0.5, 0.5]).tolist() == [2.0, 4.0]
    assert weighted_sum(d, [0.25, 0.75]).tolist() == [2.5, 5.0]
    change, state = global_change("spes", d, [0.5, 0.5])
    assert change.tolist() == [2.0, 4.0] and state == {}
    assert global_change("fedavg", d, [0.25, 0.75])[0].tolist() == [2.5, 5.0]


def test_diloco_outer_nesterov_is_torch_sgd():
    # nodes moved w=1 to 0 and 0.5: deltas -1, -0.5; pseudo-gradient 0.75; nesterov g = 0.75 + 0.9*0.75 = 1.425
    change, state = global_change("diloco", [torch.tensor([-1.0]), torch.tensor([-0.5])], [0.5, 0.5])
    assert change.item() == pytest.approx(-0.7 * 1.425, abs=1e-6) and state["w"].item() == 0.75
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    p.grad = torch.tensor([0.75])
    opt.step()
    w = 1.0 + change.item()
    assert w == pytest.approx(p.item(), abs=1e-6)
    sgd = OuterSGD(0.7, 0.9, True)
    change2, state2 = sgd.step("w", torch.tensor([-0.1]), state)
    p.grad = torch.tensor([0.1])
    opt.step()
    assert w + change2.item() == pytest.approx(p.item(), abs=1e-6)
    assert state2["w"].item() == pytest.approx(0.9 * 0.75 + 0.1)
    assert OuterSGD(0.5, 0.0, True).step("w", torch.tensor([-0.1]), {}) == (pytest.approx(torch.tensor([-0.05])), {})


def test_outer_sgd_is_within_one_rounding_of_torch_sgd_on_many_values():
    """torch.optim.SGD fuses g + momentum * buf on the CPU; ours rounds twice, as committed runs did."""
    torch.manual_seed(1)
    sgd, buf = OuterSGD(0.7, 0.9, True), torch.randn(4096) * 1e-2
    md = torch.randn(4096) * 1e-2
    change, state = sgd.step("w", md, {"w": buf.clone()})
    p = torch.zeros(4096, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    opt.state[p]["momentum_buffer"] = buf.clone()
    p.grad = -md
    opt.step()
    assert torch.equal(state["w"], opt.state[p]["momentum_buffer"])
    assert torch.allclose(change, p.detach(), rtol=0, atol=2 * torch.finfo(torch.float32).eps * change.abs().max())


def test_fedadam_is_torch_adam_on_the_pseudo_gradient_over_two_rounds():
    """Round by round: the change is exactly torch.optim.Adam's step (from 0) on g = -mean delta, its moments
    and step count are Adam's own bit for bit, and prev + changes tracks Adam run on the global itself."""
    torch.manual_seed(2)
    theta0 = torch.randn(64)
    m = method("fedadam", "outer.lr=0.01", "outer.momentum=0.9", "outer.beta2=0.99", "outer.eps=1e-3")
    ref = torch.nn.Parameter(theta0.clone())
    opt = torch.optim.Adam([ref], lr=0.01, betas=(0.9, 0.99), eps=1e-3, foreach=False)
    zero = torch.nn.Parameter(torch.zeros(64))
    opt0 = torch.optim.Adam([zero], lr=0.01, betas=(0.9, 0.99), eps=1e-3, foreach=False)
    state, theta = {}, theta0.clone()
    for r in range(2):
        deltas = [torch.randn(64) * 1e-2, torch.randn(64) * 1e-2]
        change, state = m.global_change("w", deltas, [0.5, 0.5], state)
        g = -weighted_sum(deltas, [0.5, 0.5])
        ref.grad, zero.grad = g.clone(), g.clone()
        opt.step()
        opt0.step()
        if r == 0:  # from zero, Adam's parameter is its step itself
            assert torch.equal(change, zero.detach())
        want = opt.state[ref]
        assert torch.equal(state["w#exp_avg"], want["exp_avg"]) and torch.equal(state["w#exp_avg_sq"], want["exp_avg_sq"])
        assert state["w#step"].item() == want["step"].item() == r + 1
        theta = theta + change
    assert torch.allclose(theta, ref.detach(), rtol=0, atol=1e-6)
    # round 2's change by hand: Adam's bias-corrected step on the kept moments
    b1, b2 = 0.9, 0.99
    m_hat, v_hat = state["w#exp_avg"] / (1 - b1 ** 2), state["w#exp_avg_sq"] / (1 - b2 ** 2)
    assert torch.allclose(change, -0.01 * m_hat / (v_hat.sqrt() + 1e-3), rtol=1e-5, atol=1e-9)


def test_outer_adam_state_comes_back_as_it_went_in():
    adam = OuterAdam(0.01, 0.9, 0.99, 1e-3)
    c1, s1 = adam.step("w", torch.tensor([0.5, -0.25]), {})
    c2a, s2a = adam.step("w", torch.tensor([0.1, 0.1]), {k: v.clone() for k, v in s1.items()})
    c2b, s2b = adam.step("w", torch.tensor([0.1, 0.1]), s1)
    assert torch.equal(c2a, c2b) and all(torch.equal(s2a[k], s2b[k]) for k in s2a)
    assert [k for k, _, _ in adam.state_specs("w", (2,))] == sorted(s1)
