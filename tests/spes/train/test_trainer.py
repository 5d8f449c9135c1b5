"""The node trainer: own experts + shared params trainable, foreign experts frozen with no grad/state."""
import pytest
import torch

from spes.config.schema import OptimConfig
from spes.model.transformer import CausalLM
from spes.train.planned_nodes import planned_nodes
from spes.train.schedule import lr_at
from spes.train.trainer import Trainer, build_node_trainer
from tests.conftest import tiny_config, tiny_params


def _clone(sd):
    return {k: v.clone() for k, v in sd.items()}


def test_node_trainer_freezes_foreign_experts_and_uploads_only_its_own():
    torch.manual_seed(0)
    model = CausalLM(tiny_config())
    tr = Trainer(model, owned=[2, 3], optim=OptimConfig(lr=1e-2, warmup_steps=1), total_steps=10)
    before = _clone(model.canonical_state_dict())
    x = torch.randint(0, 96, (2, 12))
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
    for name, t in up.items():
        if ".experts." in name:  # exactly the owned rows (2 and 3), as trained
            assert torch.equal(t, after[name][2:]), name
        else:
            assert torch.equal(t, after[name]), name
    assert set(up) == set(after)


def test_frozen_experts_in_bf16_and_optimizer_state_roundtrip():
    torch.manual_seed(1)
    model = CausalLM(tiny_config())
    tr = Trainer(model, [0], OptimConfig(), 10, frozen_dtype=torch.bfloat16)
    chunks = model.moe_layers()[0].experts.chunks
    assert [c.gate_up_proj.dtype for c in chunks] == [torch.float32, torch.bfloat16]
    x = torch.randint(0, 96, (2, 8))
    tr.train_step(x, x, 0)
    state = tr.optimizer_tensors()
    tr2 = Trainer(CausalLM(tiny_config()), [0], OptimConfig(), 10)
    tr2.load_optimizer_tensors(state)
    assert all(torch.equal(state[k], v) for k, v in tr2.optimizer_tensors().items())
    no_norm = {k: v for k, v in state.items() if not k.startswith("model.norm.weight::")}
    with pytest.raises(ValueError, match=r"does not match .*missing \['model.norm.weight'\]"):
        Trainer(CausalLM(tiny_config()), [1, 2], OptimConfig(), 10).load_optimizer_tensors(no_norm)


def test_build_node_trainer_follows_the_ownership_settings():
    s = tiny_params()
    s.train.frozen_dtype = "bfloat16"
    assert build_node_trainer(s, CausalLM(tiny_config()), planned_nodes(s).owned[1]).owned == (2, 3)
    s.sync.ownership = [[1], [0, 2, 3]]
    tr = build_node_trainer(s.validate(), CausalLM(tiny_config()), planned_nodes(s).owned[0])
    assert tr.owned == (1,)
    assert {c.gate_up_proj.dtype for c in tr.model.moe_layers()[0].experts.chunks if not c.trainable} == {torch.bfloat16}
    s.sync.method, s.sync.ownership = "diloco", None
    assert build_node_trainer(s.validate(), CausalLM(tiny_config()), planned_nodes(s).owned[1]).owned == (0, 1, 2, 3)


def _pair(seed=3, **kw):
    """Two identical models and trainers (own experts 1 and 2), and a batch of 4 sequences."""
    out = []
    for _ in range(2):
        torch.manual_seed(seed)
        model = CausalLM(tiny_config())
        out.append(Trainer(model, [1, 2], OptimConfig(lr=1e-2, warmup_steps=1), 10, **kw))
    g = torch.Generator().manual_seed(seed)
    return out, torch.randint(0, 96, (4, 12), generator=g), torch.randint(0, 96, (4, 12), generator=g)


def test_micro_batches_equal_one_full_batch():
    """k micro-batches with accumulated gradients = one pass over the whole batch whose load-balance loss is
    computed per micro-batch-sized group (the definition): loss, gradients and updated weights to fp32
    rounding, auxiliary losses included."""
    (acc, ref), x, y = _pair()
    acc.micro_batch_size = 2
    m = acc.train_step(x, y, 0)
    # the reference: the same step done by hand in one pass, lb over 2 groups of 2 sequences
    for g in ref.optimizer.param_groups:
        g["lr"] = lr_at(0, ref.cfg, ref.total_steps)
    ref.optimizer.zero_grad()
    out = ref.model(x, y, None, lb_groups=2)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_([p for _, p in ref.trainable_named_parameters()], ref.cfg.grad_clip)
    ref.optimizer.step()
    assert out.lb.item() != pytest.approx(ref.model(x, y).lb.item(), abs=1e-7)  # grouping matters: it is tested
    assert m.ce.item() == pytest.approx(out.ce.item(), rel=1e-6)
    for (n, p), (_, q) in zip(acc.trainable_named_parameters(), ref.trainable_named_parameters()):
        # fp32 rounding of sums taken in another order: relative to the tensor's largest gradient
        assert (p.grad - q.grad).abs().max() <= 1e-6 * q.grad.abs().max(), n
        # Adam's first step is lr * g / (|g| + eps): where |g| is near eps, rounding in g moves the update by
        # a fraction of lr, so weights agree to 1e-3 of a step
        assert torch.allclose(p, q, rtol=0, atol=1e-3 * acc.cfg.lr), n


def test_a_step_reports_its_gradient_norm_before_clipping():
    (clipped, free), x, y = _pair(seed=5)
    clipped.cfg.grad_clip, free.cfg.grad_clip = 1e-3, 0.0  # so the clip does act
    a, b = clipped.train_step(x, y, 0), free.train_step(x, y, 0)
    grads = lambda tr: [p.grad for _, p in tr.trainable_named_parameters()]  # noqa: E731
    assert b.grad_norm is not None and b.grad_norm.item() == torch.nn.utils.get_total_norm(grads(free)).item()
    assert a.grad_norm is not None and a.grad_norm.item() == b.grad_norm.item() > 1e-3  # the same batch and weights
    assert torch.nn.utils.get_total_norm(grads(clipped)).item() == pytest.approx(1e-3, rel=1e-4)


def test_a_step_reports_its_load_balance_and_z_terms_as_the_model_computes_them():
    """The step's lb and z terms (watched in TensorBoard) are the model's on the step's weights, meaned over
    micro-batches like ce: reported, not trained on twice (the weights after the step are unchanged by it)."""
    (tr, ref), x, y = _pair(seed=5)
    tr.micro_batch_size = 2
    parts = [ref.model(x[i:i + 2], y[i:i + 2]) for i in (0, 2)]  # before either step: the same weights
    m = tr.train_step(x, y, 0)
    assert m.lb is not None and m.z is not None
    assert m.lb.item() == pytest.approx(((parts[0].lb + parts[1].lb) / 2).item(), rel=1e-6)
    assert m.z.item() == pytest.approx(((parts[0].z + parts[1].z) / 2).item(), rel=1e-6)
    assert not m.lb.requires_grad and not m.z.requires_grad


def test_the_step_loss_is_the_mean_of_the_micro_batch_losses():
    (tr, _), x, y = _pair(seed=4)
    full = tr.model(x, y, None, lb_groups=2)
    parts = [tr.model(x[i:i + 2], y[i:i + 2]) for i in (0, 2)]
    for key in ("loss", "ce", "lb", "z"):
        mean = (getattr(parts[0], key) + getattr(parts[1], key)) / 2
        assert getattr(full, key).item() == pytest.approx(mean.item(), rel=1e-6), key


def test_activation_checkpointing_gives_the_same_numbers():
    (plain, ckpt), x, y = _pair(seed=5)
    ckpt.model.activation_checkpointing = True
    for step in range(2):
        a, b = plain.train_step(x, y, step), ckpt.train_step(x, y, step)
        assert torch.equal(a.ce, b.ce)
    for (n, p), (_, q) in zip(plain.model.named_parameters(), ckpt.model.named_parameters()):
        assert torch.equal(p, q), n


def test_build_node_trainer_applies_micro_batches_and_checkpointing():
    s = tiny_params()
    s.train.micro_batch_size, s.train.activation_checkpointing = 2, "block"
    tr = build_node_trainer(s.validate(), CausalLM(tiny_config()), planned_nodes(s).owned[0])
    assert tr.micro_batch_size == 2 and tr.model.activation_checkpointing


@pytest.mark.slow  # torch.compile of two blocks: minutes on a loaded 2-core machine
def test_compiled_blocks_train_like_eager_and_replay_exactly():
    """train.compile: the compiled step tracks the eager one to rounding, and is itself deterministic, so a
    resumed compiled node (a fresh compile of the same blocks) gives the same bits."""
    s = tiny_params()
    runs = []
    for compiled in (False, True, True):
        torch.manual_seed(6)
        model = CausalLM(tiny_config())
        s.train.compile = compiled
        tr = build_node_trainer(s, model, planned_nodes(s).owned[0])
        x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(6))
        runs.append([tr.train_step(x, x, step).ce.item() for step in range(2)] + [model.canonical_state_dict()])
    eager, comp, again = runs
    assert comp[:2] == pytest.approx(eager[:2], rel=1e-4)
    assert comp[:2] == again[:2] and all(torch.equal(comp[2][k], again[2][k]) for k in comp[2])


def test_state_bytes_counts_weights_gradients_and_adam_as_the_planner_does():
    from spes.train.plan import node_memory

    cfg = tiny_config()
    s = tiny_params()
    s.train.frozen_dtype = "bfloat16"
    tr = build_node_trainer(s, CausalLM(cfg), planned_nodes(s).owned[1])
    x = torch.randint(0, 96, (2, 8))
    tr.train_step(x, x, 0)
    plan = node_memory(s, 1)
    assert tr.state_bytes() == plan["total_bytes"]  # weights (frozen in bf16) + fp32 grads and two moments
