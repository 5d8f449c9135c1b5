"""Adam state across a change of ownership: experts kept keep their state, experts taken over start fresh,
each chunk's step count exact, the encoding residual's rows following the experts."""
import torch

from spes.config.schema import OptimConfig
from spes.model.transformer import CausalLM
from spes.train.expert_state import chunk_state, expert_steps, parse_ranged, ranged_name, remap_rows
from spes.train.trainer import Trainer
from tests.conftest import tiny_config

NO_CLIP = OptimConfig(grad_clip=0.0, warmup_steps=1)  # clipping couples parameters through the global norm


def _trained(owned, steps=2, seed=0):
    torch.manual_seed(seed)
    model = CausalLM(tiny_config())
    tr = Trainer(model, owned, NO_CLIP, 10)
    for i in range(steps):
        x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(i))
        tr.train_step(x, x, i)
    return model, tr


def _clone(model):
    m = CausalLM(tiny_config())
    m.load_canonical_state_dict(model.canonical_state_dict())
    return m


def _params(tr):
    return {n: p.detach().clone() for n, p in tr.model.named_parameters()}


def test_ranged_names_and_chunk_state():
    assert ranged_name("model.layers.0.mlp.experts.down_proj", 2, 4) == "model.layers.0.mlp.experts.down_proj[2:4]"
    assert parse_ranged("model.layers.0.mlp.experts.down_proj[2:4]") == ("model.layers.0.mlp.experts.down_proj", 2, 4)
    assert parse_ranged("model.layers.0.mlp.experts.chunks.1.down_proj") is None
    _, tr = _trained([0, 1])
    state = tr.optimizer_tensors()
    assert "model.layers.0.mlp.experts.gate_up_proj[0:2]::exp_avg" in state
    assert expert_steps(state) == {0: 2.0, 1: 2.0}
    one = chunk_state(state, "model.layers.0.mlp.experts.gate_up_proj", 1, 2)
    assert torch.equal(one["exp_avg"], state["model.layers.0.mlp.experts.gate_up_proj[0:2]::exp_avg"][1:2])
    assert chunk_state(state, "model.layers.0.mlp.experts.gate_up_proj", 2, 4) is None


def test_a_node_that_keeps_one_expert_and_takes_over_another_trains_both_exactly():
    """Owner of [0, 1] becomes owner of [1, 2]: expert 1 goes on with its Adam state (step 3), expert 2 starts
    fresh (step 1), the shared parameters go on with theirs. One step equals, parameter for parameter, a node
    that owns [1] with that state (for expert 1 and the shared part) and a node that owns only [2] fresh."""
    model, tr = _trained([0, 1])
    state = tr.optimizer_tensors()
    x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(7))

    both = Trainer(_clone(model), [1, 2], NO_CLIP, 10, expert_steps=expert_steps(state))
    chunks = both.model.moe_layers()[0].experts.chunks
    assert [(c.start, c.end, c.trainable) for c in chunks] == [(0, 1, False), (1, 2, True), (2, 3, True), (3, 4, False)]
    both.load_optimizer_tensors(state)
    keep = Trainer(_clone(model), [1], NO_CLIP, 10)
    keep.load_optimizer_tensors({k: v for k, v in state.items() if "experts" not in k or "[0:2]" in k})
    fresh = Trainer(_clone(model), [2], NO_CLIP, 10)
    for t in (both, keep, fresh):
        t.train_step(x, x, 2)
    got, want_keep, want_fresh = both.model.canonical_state_dict(), keep.model.canonical_state_dict(), \
        fresh.model.canonical_state_dict()
    for name, t in got.items():
        if ".mlp.experts." in name:
            assert torch.equal(t[1], want_keep[name][1]) and torch.equal(t[2], want_fresh[name][2]), name
            assert torch.equal(t[0], model.canonical_state_dict()[name][0])  # given away: not trained here
        else:
            assert torch.equal(t, want_keep[name]), name
    after = both.optimizer_tensors()
    assert expert_steps(after) == {1: 3.0, 2: 1.0}
    # saved and loaded again, the chunks and state come back as they were
    again = Trainer(_clone(both.model), [1, 2], NO_CLIP, 10, expert_steps=expert_steps(after))
    again.load_optimizer_tensors(after)
    assert all(torch.equal(after[k], v) for k, v in again.optimizer_tensors().items())


def test_state_written_before_ranged_names_still_loads():
    _, tr = _trained([2, 3])
    legacy = {}
    for name, p in tr.trainable_named_parameters():
        st = tr.optimizer.state[p]
        legacy.update({f"{name}::exp_avg": st["exp_avg"].clone(), f"{name}::exp_avg_sq": st["exp_avg_sq"].clone(),
                       f"{name}::step": torch.as_tensor(st["step"], dtype=torch.float64).reshape(1)})
    assert any(".chunks." in k for k in legacy)
    tr2 = Trainer(CausalLM(tiny_config()), [2, 3], NO_CLIP, 10)
    tr2.load_optimizer_tensors(legacy)
    assert all(torch.equal(tr.optimizer_tensors()[k], v) for k, v in tr2.optimizer_tensors().items())


def test_residual_rows_follow_the_experts():
    t = torch.arange(6.0).reshape(3, 2)  # rows of experts 0, 2, 3
    assert remap_rows(t, (0, 2, 3), (2, 3, 5)).tolist() == [[2.0, 3.0], [4.0, 5.0], [0.0, 0.0]]
