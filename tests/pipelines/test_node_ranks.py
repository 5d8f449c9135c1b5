"""A node of several ranks (a torchrun job, gloo on the CPU), its model replicated (ddp) or sharded (fsdp):
the same step as one rank with the whole batch, and a resumed multi-rank node equals an uninterrupted one."""
import pytest
import torch

from pipelines.node_ranks import run_node
from spes.config.loader import params_from_dict, to_dict
from spes.errors import ConfigError
from spes.round.aggregator import aggregate_round
from spes.round.context import RoundContext
from spes.run.layout import MODEL_FILE
from spes.sync.deltas import EXPERTS_FILE, SHARED_FILE
from tests.spes.round.test_round import make_params, start


def params(tmp_path, name, ranks, batch=4, micro=1, parallel="ddp"):
    p = make_params(tmp_path, name)
    p.train.batch_size, p.train.micro_batch_size, p.orchestration.gpus_per_node = batch, micro, ranks
    p.train.node_parallel = parallel
    p.orchestration.min_nodes = 1  # node 0 alone makes each round: the other node's ranks are not needed
    return params_from_dict(to_dict(p))  # validated like a params file


def node0(p, run, r, tokens, checkpoint=False):
    meta = run_node(RoundContext.build(p, "r", run.store), r, 0, tokens, threads=2, checkpoint=checkpoint)
    aggregate_round(RoundContext.build(p, "r", run.store), r, min_nodes=1)
    return meta


def upload(run, r):
    return run.store.read_bundle(run.layout.node_dir(r, 0)).files


def global_sha(run, r):
    return run.store.read_manifest(run.layout.global_dir(r))["files"][MODEL_FILE]["sha256"]


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def two_ranks(request, tmp_path_factory, tiny_tokens):
    tmp = tmp_path_factory.mktemp("ranks")
    p = params(tmp, "two", ranks=2, parallel=request.param)
    run = start(p)
    metas = [node0(p, run, r, tiny_tokens) for r in (1, 2)]
    return p, run, metas


def test_two_ranks_equal_one_rank_with_the_whole_batch(two_ranks, tmp_path, tiny_tokens):
    p2, run2, metas2 = two_ranks
    p1 = params(tmp_path, "one", ranks=1)
    run1 = start(p1)
    meta1 = node0(p1, run1, 1, tiny_tokens)
    assert metas2[0].upload.ranks == 2 and meta1.upload.ranks == 1 and metas2[0].tokens == meta1.tokens
    assert metas2[0].upload.losses == pytest.approx(meta1.upload.losses, rel=1e-5)
    a, b = upload(run2, 1), upload(run1, 1)
    for f in (SHARED_FILE, EXPERTS_FILE):
        for name, t in b[f].items():  # fp32 deltas: the updates agree to rounding (and Adam's eps)
            assert (a[f][name] - t).abs().max() <= 1e-3 * p1.train.optim.lr, name
    assert metas2[0].upload.expert_load == meta1.upload.expert_load


@pytest.mark.slow
def test_a_resumed_two_rank_node_equals_an_uninterrupted_one(two_ranks, tmp_path, tiny_tokens):
    p, run, _ = two_ranks
    q = params(tmp_path, "resumed", ranks=2, parallel=p.train.node_parallel)
    resumed = start(q)
    node0(q, resumed, 1, tiny_tokens, checkpoint=True)
    import shutil

    shutil.rmtree(tmp_path / "resumed-nodes")  # a new machine: the state comes from the checkpoint
    node0(q, resumed, 2, tiny_tokens)
    assert global_sha(resumed, 2) == global_sha(run, 2)


def test_bad_rank_settings_fail_before_compute(tmp_path):
    p = make_params(tmp_path)
    d = to_dict(p)
    d["orchestration"]["gpus_per_node"], d["train"]["batch_size"] = 3, 4
    with pytest.raises(ConfigError, match=r"train.batch_size \(4\) must be a multiple of orchestration.gpus_per_node \(3\)"):
        params_from_dict(d)
    d["orchestration"]["gpus_per_node"], d["train"]["micro_batch_size"] = 2, 3
    with pytest.raises(ConfigError, match=r"train.micro_batch_size \(3\) must divide the per-rank batch"):
        params_from_dict(d)
    if not torch.cuda.is_available():
        from pipelines.node_ranks import check_ranks
        from spes.errors import DeviceError

        d["train"]["micro_batch_size"], d["orchestration"]["device"] = 1, "cuda"
        with pytest.raises(DeviceError, match="sees no CUDA device"):
            check_ranks(params_from_dict(d))
