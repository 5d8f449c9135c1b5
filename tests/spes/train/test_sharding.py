"""A node sharded over 2 ranks with FSDP2 (gloo on the CPU) against the same node in one process: the same
steps within fp32 rounding, frozen experts sharded with no gradient or optimizer state and unchanged, the
upload and optimizer state gathered exactly, and a trainer rebuilt from them continuing bitwise."""
import pytest
import torch
import torch.multiprocessing as mp

from spes.config.schema import OptimConfig
from spes.model.transformer import CausalLM
from spes.train.trainer import Trainer
from tests.conftest import tiny_config

CFG = dict(vocab_size=96, tie_embeddings=False)
OWNED, STEPS, MORE, B, S = (1, 2), 3, 2, 4, 12
OPTIM = OptimConfig(lr=1e-2, warmup_steps=1, grad_clip=0.0)


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (B, S), generator=g) for _ in range(n)]


def _initial():
    torch.manual_seed(0)
    return CausalLM(tiny_config(**CFG)).canonical_state_dict()


def _trainer(sd, parallel="ddp", lead=True):
    if parallel == "fsdp":
        with torch.device("meta"):
            model = CausalLM(tiny_config(**CFG))
        tr = Trainer(model, OWNED, OPTIM, 10, torch.bfloat16, parallel="fsdp", device=torch.device("cpu"))
        tr.load_global(sd if lead else None)
        return tr
    model = CausalLM(tiny_config(**CFG))
    model.load_canonical_state_dict(sd)
    # micro-batches of a rank's share: the same load-balance groups as the 2 ranks
    return Trainer(model, OWNED, OPTIM, 10, torch.bfloat16, micro_batch_size=B // 2)


def _with_upload(sd, up):
    """The canonical model after a node's steps: its upload, other experts' rows as they were."""
    out = dict(sd)
    for name, t in up.items():
        if ".experts." in name:
            out[name] = sd[name].clone()
            out[name][list(OWNED)] = t
        else:
            out[name] = t
    return out


def _steps(tr, batches, first, rank=0, ranks=1):
    share = slice(rank * B // ranks, (rank + 1) * B // ranks)
    return [float(tr.train_step(x[share], x[share], first + i).ce) for i, x in enumerate(batches)]


def _rank(rank, init_file, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        lead, sd = rank == 0, _initial()
        tr = _trainer(sd, "fsdp", lead)
        frozen = [(n, p) for n, p in tr.model.named_parameters() if not p.requires_grad]
        frozen_before = {n: p.to_local().clone() for n, p in frozen}
        batches = _batches(STEPS + MORE)
        losses = _steps(tr, batches[:STEPS], 0, rank, 2)
        facts = {
            "sharded": all(type(p).__name__ == "DTensor" and p.to_local().numel() < p.numel()
                           for _, p in tr.model.named_parameters() if p.shape[0] > 1),
            "frozen_names": [n for n, _ in frozen],
            "frozen_dtypes": sorted({str(p.dtype) for _, p in frozen}),
            "frozen_no_grad": all(p.grad is None for _, p in frozen),
            "frozen_no_state": all(p not in tr.optimizer.state for _, p in frozen),
            "frozen_unchanged": all(torch.equal(p.to_local(), frozen_before[n]) for n, p in frozen),
        }
        up, optim = tr.upload(), tr.optimizer_tensors()
        assert (up == {} and optim == {}) or lead  # only rank 0 holds full tensors
        # a trainer rebuilt from what rank 0 would store continues exactly as the one that made it
        again = _trainer(_with_upload(sd, up) if lead else None, "fsdp", lead)
        again.load_optimizer_tensors(optim if lead else None)
        cont = _steps(tr, batches[STEPS:], STEPS, rank, 2)
        resumed = _steps(again, batches[STEPS:], STEPS, rank, 2)
        up_cont, up_resumed = tr.upload(), again.upload()
        if lead:
            torch.save({"losses": losses, "facts": facts, "upload": up, "optim": optim, "cont": cont,
                        "resumed": resumed, "up_cont": up_cont, "up_resumed": up_resumed}, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    out = str(tmp / "out.pt")
    mp.start_processes(_rank, args=(str(tmp / "init"), out), nprocs=2, start_method="spawn")
    return torch.load(out)


@pytest.fixture(scope="module")
def single():
    tr = _trainer(_initial())
    losses = _steps(tr, _batches(STEPS), 0)
    return {"losses": losses, "upload": tr.upload(), "optim": tr.optimizer_tensors()}


def test_an_fsdp_node_takes_the_steps_of_one_process(sharded, single):
    assert sharded["losses"] == pytest.approx(single["losses"], rel=1e-6)
    assert set(sharded["upload"]) == set(single["upload"])
    for name, t in single["upload"].items():
        assert sharded["upload"][name].shape == t.shape
        # fp32 rounding of the gradient reductions, through Adam's normalization: within 1e-3 of one step
        torch.testing.assert_close(sharded["upload"][name], t, rtol=0, atol=1e-3 * OPTIM.lr, msg=name)
    assert set(sharded["optim"]) == set(single["optim"])
    for name, t in single["optim"].items():
        # the moments hold the gradients: equal to their fp32 rounding, relative to the tensor's scale
        assert (sharded["optim"][name] - t).abs().max() <= 1e-4 * t.abs().max(), name


def test_frozen_experts_are_sharded_without_gradient_or_optimizer_state(sharded):
    f = sharded["facts"]
    assert f["sharded"]
    assert f["frozen_names"] and all(".mlp.experts.chunks." in n for n in f["frozen_names"])
    assert f["frozen_dtypes"] == ["torch.bfloat16"]
    assert f["frozen_no_grad"] and f["frozen_no_state"] and f["frozen_unchanged"]


def test_an_fsdp_node_rebuilt_from_its_stored_state_continues_bitwise(sharded):
    assert sharded["resumed"] == sharded["cont"]
    assert sharded["up_resumed"].keys() == sharded["up_cont"].keys()
    for name, t in sharded["up_cont"].items():
        assert torch.equal(sharded["up_resumed"][name], t), name


def test_the_upload_holds_the_trained_rows_in_canonical_layout(sharded):
    up = sharded["upload"]
    E = tiny_config(**CFG).num_experts
    for i in range(tiny_config(**CFG).num_layers):
        gu = up[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        assert gu.shape[0] == len(OWNED) < E and gu.dtype == torch.float32


def test_fsdp_needs_several_ranks_per_node(tmp_path):
    from spes.config.loader import params_from_dict, to_dict
    from spes.config.schema import Params
    from spes.errors import ConfigError

    d = to_dict(Params())
    d["train"]["node_parallel"] = "fsdp"
    with pytest.raises(ConfigError, match="train.node_parallel is fsdp.*gpus_per_node is 1"):
        params_from_dict(d)
    d["train"]["node_parallel"] = "zero3"
    with pytest.raises(ConfigError, match="train.node_parallel must be one of ddp|fsdp"):
        params_from_dict(d)
    d["train"]["node_parallel"], d["orchestration"]["gpus_per_node"] = "fsdp", 2
    assert params_from_dict(d).train.node_parallel == "fsdp"

