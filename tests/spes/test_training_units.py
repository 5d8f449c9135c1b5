import pytest
import torch

from spes.aggregate import NodeResult, OuterState, aggregate_diloco, aggregate_mean, aggregate_spes
from spes.config import ConfigError, ModelConfig, OptimConfig, Params, validate
from spes.merging import donors_by_gate_similarity, merge_alpha, merge_due, merge_layer
from spes.model import CausalLM
from spes.ownership import Ownership, OwnershipError
from spes.trainer import NodeTrainer, lr_at


def tiny():
    return ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=8, num_layers=2, num_heads=2,
                       num_kv_heads=2, num_experts=4, top_k=2, max_seq_len=32)


def test_node_trainer_freezes_foreign_experts():
    torch.manual_seed(0)
    model = CausalLM(tiny())
    tr = NodeTrainer(model, owned=[2, 3], optim=OptimConfig(lr=1e-2, warmup_steps=1), total_steps=10)
    before = model.canonical_state_dict()
    before = {k: v.clone() for k, v in before.items()}
    x = torch.randint(0, 64, (2, 12))
    tr.train_step(x, x, 0)
    frozen = [c for m in model.moe_layers() for c in m.experts.chunks if not c.trainable]
    assert frozen and all(c.gate_up_proj.grad is None and c.down_proj.grad is None for c in frozen)
    opt_params = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    assert all(id(c.gate_up_proj) not in opt_params and c.gate_up_proj not in tr.optimizer.state for c in frozen)
    after = model.canonical_state_dict()
    for i in range(2):
        gu = f"model.layers.{i}.mlp.experts.gate_up_proj"
        assert torch.equal(after[gu][:2], before[gu][:2])  # foreign experts untouched
        assert not torch.equal(after[gu][2:], before[gu][2:])  # own experts trained
    assert not torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    up = tr.upload()
    assert up["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 2


def test_frozen_experts_in_bf16_and_optimizer_state_roundtrip():
    torch.manual_seed(1)
    model = CausalLM(tiny())
    tr = NodeTrainer(model, [0], OptimConfig(), 10, frozen_dtype=torch.bfloat16)
    chunks = model.moe_layers()[0].experts.chunks
    assert [c.gate_up_proj.dtype for c in chunks] == [torch.float32, torch.bfloat16]
    x = torch.randint(0, 64, (2, 8))
    tr.train_step(x, x, 0)
    state = tr.optimizer_tensors()
    tr2 = NodeTrainer(CausalLM(tiny()), [0], OptimConfig(), 10)
    tr2.load_optimizer_tensors(state)
    assert all(torch.equal(state[k], v) for k, v in tr2.optimizer_tensors().items())
    with pytest.raises(ValueError, match="does not match"):
        NodeTrainer(CausalLM(tiny()), [1, 2], OptimConfig(), 10).load_optimizer_tensors(state)


def test_lr_schedule():
    c = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, c, 110) == pytest.approx(0.1) and lr_at(9, c, 110) == pytest.approx(1.0)
    assert lr_at(60, c, 110) == pytest.approx(0.55) and lr_at(110, c, 110) == pytest.approx(0.1)


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
    assert aggregate_mean(prev, res)["w"].item() == 0.25


def test_merging_exact():
    assert merge_alpha(0, 0.05, 200) == 0.05 and merge_alpha(100, 0.05, 200) == 0.025
    assert merge_alpha(300, 0.05, 200) == 0.0
    assert merge_due(100, 50, 0.02) and not merge_due(75, 50, 0.02) and not merge_due(200, 50, 0.0)
    # 3 experts, I=1, D=2: gate rows e0=[1,0], e1=[1,0.1], e2=[0,1]
    gate_up = torch.tensor([[[1.0, 0.0], [5.0, 5.0]], [[1.0, 0.1], [1.0, 1.0]], [[0.0, 1.0], [3.0, 3.0]]])
    down = torch.tensor([[[2.0], [0.0]], [[4.0], [0.0]], [[8.0], [0.0]]])
    donors = donors_by_gate_similarity(gate_up, 1)
    assert donors.flatten().tolist() == [1, 0, 1]
    out = merge_layer({"gate_up_proj": gate_up, "down_proj": down}, alpha=0.5, top_k=1)
    # theta + 0.5 * (donor - theta)
    assert out["down_proj"][:, 0, 0].tolist() == [3.0, 3.0, 6.0]
    assert out["gate_up_proj"][0, 1].tolist() == [3.0, 3.0]
    out2 = merge_layer({"gate_up_proj": gate_up, "down_proj": down}, alpha=1.0, top_k=2)
    assert out2["down_proj"][:, 0, 0].tolist() == [6.0, 5.0, 3.0]


def test_ownership():
    o = Ownership.contiguous(8, 4)
    assert o.owned(1) == (2, 3) and o.owner_of(7) == 3
    with pytest.raises(OwnershipError, match="cannot be split evenly"):
        Ownership.contiguous(6, 4)
    assert Ownership.from_lists([[0, 3], [1, 2]], 4).owner_of(3) == 0
    with pytest.raises(OwnershipError, match="owned by nodes 0 and 1"):
        Ownership.from_lists([[0, 1], [1, 2, 3]], 4)
    with pytest.raises(OwnershipError, match=r"experts \[3\] have no owner"):
        Ownership.from_lists([[0, 1], [2]], 4)


@pytest.mark.parametrize("change,msg", [
    (lambda p: setattr(p.spes, "num_nodes", 3), "not divisible by spes.num_nodes"),
    (lambda p: setattr(p.model, "top_k", 9), "model.top_k"),
    (lambda p: setattr(p.tokenize, "corpus", "/nonexistent/*.txt"), "no file matches"),
    (lambda p: setattr(p.spes, "method", "gossip"), "spes.method"),
    (lambda p: setattr(p.orchestration, "min_nodes", 5), "orchestration.min_nodes"),
])
def test_config_errors_name_the_key(change, msg):
    p = Params()
    change(p)
    with pytest.raises(ConfigError, match=msg):
        validate(p)


def test_params_yaml_unknown_key(tmp_path):
    from spes.config import load_params

    f = tmp_path / "p.yaml"
    f.write_text("spes:\n  nodes: 3\n")
    with pytest.raises(ConfigError, match="nodes"):
        load_params(str(f))
    f.write_text("model:\n  hidden_size: lots\n")
    with pytest.raises(ConfigError, match="hidden_size"):
        load_params(str(f))
