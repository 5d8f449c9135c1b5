"""Rounds as library calls against a local Store, no Prefect: node rounds, aggregation, codecs, node state,
quorum, rejected uploads, retries."""
import pytest
import torch

from spes.config.schema import Params
from spes.data.tokens import TokenData
from spes.errors import NodeStateError, NonFiniteLoss, QuorumError, UploadsRejected
from spes.model.transformer import CausalLM
from spes.round.aggregator import aggregate_round
from spes.round.context import RoundContext
from spes.round.fetch import delta_files
from spes.round.node import NodeRound, node_report
from spes.run.identity import InitModel, settings_fingerprint
from spes.run.layout import MODEL_FILE
from spes.run.local_runs import node_state_root
from spes.run.node_state import NodeStateDir
from spes.run.run import Run
from spes.storage.store import Store
from spes.storage.tensorio import tensors_sha256
from spes.sync.codecs import make_codec
from spes.sync.deltas import EXPERTS_FILE, SHARED_FILE, apply_delta
from spes.sync.method import weighted_sum
from spes.sync.methods import sync_method
from tests.conftest import tiny_params


def make_params(tmp_path, name="s", **sync) -> Params:
    p = tiny_params(vocab_size=512)
    s, t, m = p.sync, p.train, p.merge
    s.num_nodes, s.every_steps, s.rounds, s.warmup_rounds, t.batch_size, t.seq_len = 2, 2, 4, 2, 2, 16
    p.dense.seq_len = p.eval.seq_len = 16  # a valid params file (nodes of several ranks re-validate it)
    m.interval, m.decay_steps, m.top_k = 4, 100, 2  # merging at round 2 (step 4)
    for k, v in sync.items():
        setattr(p.sync, k, v)
    p.storage.url, p.orchestration.device = str(tmp_path / f"{name}-storage"), "cpu"
    p.orchestration.node_state_dir = str(tmp_path / f"{name}-nodes")
    return p


def start(p: Params) -> Run:
    store = Store.from_config(p.storage)
    torch.manual_seed(0)
    run = Run(store, "r")
    run.ensure(settings_fingerprint(p), InitModel.from_state(CausalLM(p.model).canonical_state_dict(), p.model, "x"))
    return run


def do_round(p, run, data, r, nodes=(0, 1), **kw):
    metas = [NodeRound(RoundContext.build(p, "r", run.store), r, i, data).run() for i in nodes]
    return metas, aggregate_round(RoundContext.build(p, "r", run.store), r, **kw)


@pytest.fixture(scope="module")
def data(tiny_tokens):
    return TokenData.open(tiny_tokens)


def _global(run, r):
    return run.store.read_bundle(run.layout.global_dir(r)).files[MODEL_FILE]


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_every_node_rebuilds_the_committed_global_bit_for_bit(tmp_path, data, codec):
    p = make_params(tmp_path, codec=codec)
    run = start(p)
    c = make_codec(codec)
    for r in (1, 2, 3):
        metas, agg = do_round(p, run, data, r)
        assert agg.merged == (r == 2)
        dm = run.store.read_manifest(run.layout.delta_dir(r))
        rows = {f: ref["rows"] for f, ref in dm["meta"]["expert_files"].items()}
        rebuilt = apply_delta(_global(run, r - 1), c, sync_method(p), delta_files(run.store, run.layout, r, dm),
                              rows)
        committed_sha = run.store.read_manifest(run.layout.global_dir(r))["files"][MODEL_FILE]["sha256"]
        assert tensors_sha256(rebuilt) == committed_sha == dm["meta"]["global_sha256"]
        refs = dm["meta"]["expert_files"]
        assert sorted(refs) == ["experts-000.safetensors", "experts-001.safetensors"]
        if r == 2:  # merging changed every expert: each owner's merged rows are in the delta itself
            assert all(ref["source"] is None and name in dm["files"] for name, ref in refs.items())
        else:  # the owners' uploads are the delta of their rows: referred to, not copied
            assert [ref["source"] for ref in refs.values()] == [run.layout.node_dir(r, i) for i in (0, 1)]
            assert set(dm["files"]) == {SHARED_FILE}
    info = run.info()
    for i in (0, 1):  # what each node holds (rebuilt from deltas in round 3) has the committed sha256
        base = NodeStateDir(node_state_root(p), run.store.location, "r", info["run_id"], i).base()
        assert base == (2, run.store.read_manifest(run.layout.global_dir(2))["files"][MODEL_FILE]["sha256"])


def test_spes_aggregation_exact_and_downloads_skip_own_experts(tmp_path, data):
    p = make_params(tmp_path)
    run = start(p)
    do_round(p, run, data, 1)
    ups = [run.store.read_bundle(run.layout.node_dir(1, i)).files for i in (0, 1)]
    prev, new = _global(run, 0), _global(run, 1)
    for name, t in new.items():
        if ".experts." in name:  # each expert = prev + its owner's delta (the owner's rows only)
            for i, rows in ((0, slice(0, 2)), (1, slice(2, 4))):
                assert torch.equal(t[rows], prev[name][rows] + ups[i][EXPERTS_FILE][name]), name
        else:
            mean = weighted_sum([ups[0][SHARED_FILE][name], ups[1][SHARED_FILE][name]], [0.5, 0.5])
            assert torch.equal(t, prev[name] + mean), name
    metas, _ = do_round(p, run, data, 2)
    model_bytes = run.store.read_manifest(run.layout.global_dir(0))["files"][MODEL_FILE]["bytes"]
    dm = run.store.read_manifest(run.layout.delta_dir(1))
    shared, refs = dm["files"][SHARED_FILE]["bytes"], dm["meta"]["expert_files"]
    other, own = refs["experts-001.safetensors"]["bytes"], refs["experts-000.safetensors"]["bytes"]
    assert metas[0].bytes_down < model_bytes  # the delta minus its own experts, not the whole model
    assert shared + other <= metas[0].bytes_down < shared + other + own


def test_spes_with_an_outer_nesterov_step_on_the_shared_parameters_exact(tmp_path, data):
    """outer.shared nesterov: shared tensors take DiLoCo's outer step on the nodes' mean delta (momentum
    kept in the global across rounds), experts still their owner's delta."""
    from spes.run.layout import OUTER_FILE
    from spes.sync.outer import OuterSGD

    p = make_params(tmp_path)
    p.outer.shared = "nesterov"
    p.merge.enabled = False  # experts: their owner's delta alone, in both rounds
    run = start(p)
    bufs = {}
    for r in (1, 2):
        do_round(p, run, data, r)
        ups = [run.store.read_bundle(run.layout.node_dir(r, i)).files for i in (0, 1)]
        prev, new = _global(run, r - 1), _global(run, r)
        outer = run.store.read_bundle(run.layout.global_dir(r)).files[OUTER_FILE]
        for name, t in new.items():
            if ".experts." in name:
                for i, rows in ((0, slice(0, 2)), (1, slice(2, 4))):
                    assert torch.equal(t[rows], prev[name][rows] + ups[i][EXPERTS_FILE][name]), name
                assert name not in outer  # no outer state for experts
            else:
                mean = weighted_sum([ups[0][SHARED_FILE][name], ups[1][SHARED_FILE][name]], [0.5, 0.5])
                change, state = OuterSGD(0.7, 0.9, True).step(name, mean, {name: bufs[name]} if name in bufs else {})
                bufs[name] = state[name]
                assert torch.equal(t, prev[name] + change) and torch.equal(outer[name], bufs[name]), name
    assert run.global_meta(2).method == "spes"


@pytest.mark.parametrize("merge", [False, True])
def test_spes_with_the_outer_nesterov_step_on_experts_too_exact(tmp_path, data, caplog, merge):
    """outer.experts nesterov (with outer.shared nesterov): each expert tensor takes the same outer SGD step
    on its owners' deltas, its momentum buffer (E x ...) kept beside the global across rounds; the shared
    tensors as with outer.shared alone. Two rounds by hand; the nodes rebuild each global from the delta
    (no whole download). With merging on, the layer is merged after the step (round 2 merges)."""
    import logging

    from spes.run.layout import OUTER_FILE
    from spes.sync.merging import merge_experts
    from spes.sync.outer import OuterSGD

    p = make_params(tmp_path)
    p.outer.shared, p.outer.experts, p.merge.enabled = "nesterov", "nesterov", merge
    p.validate()
    run = start(p)
    bufs: dict = {}
    sgd = OuterSGD(0.7, 0.9, True)
    with caplog.at_level(logging.WARNING):
        for r in (1, 2, 3):
            do_round(p, run, data, r)
            ups = [run.store.read_bundle(run.layout.node_dir(r, i)).files for i in (0, 1)]
            prev, new = _global(run, r - 1), _global(run, r)
            outer = run.store.read_bundle(run.layout.global_dir(r)).files[OUTER_FILE]
            want = {}
            for name, t in prev.items():
                if ".experts." in name:
                    delta = torch.zeros_like(t)
                    delta[0:2], delta[2:4] = ups[0][EXPERTS_FILE][name], ups[1][EXPERTS_FILE][name]
                    state = {name: bufs[name]} if name in bufs else {}
                    change, state = sgd.step_rows(name, delta, torch.arange(4), state)
                else:
                    mean = weighted_sum([ups[0][SHARED_FILE][name], ups[1][SHARED_FILE][name]], [0.5, 0.5])
                    change, state = sgd.step(name, mean, {name: bufs[name]} if name in bufs else {})
                bufs[name] = state[name]
                want[name] = t + change
                assert torch.equal(outer[name], bufs[name]), name
            alpha = run.global_meta(r).merge_alpha
            if alpha:  # merged after the step; the global takes prev + (merged - prev), as the nodes add it
                merged = merge_experts(want, alpha, p.merge.top_k)
                want = {n: prev[n] + (merged[n] - prev[n]) if ".experts." in n else want[n] for n in want}
            assert merge == bool(alpha) or r != 2
            for name in want:
                assert torch.equal(new[name], want[name]), (r, name)
    assert "differs from the committed one" not in caplog.text and "unusable" not in caplog.text


def test_an_expert_row_whose_owner_is_absent_keeps_its_value_and_momentum():
    from spes.sync.outer import OuterSGD

    sgd = OuterSGD(0.7, 0.9, True)
    buf = torch.tensor([[1.0], [2.0], [3.0]])
    change, state = sgd.step_rows("w", torch.tensor([[0.5], [9.0], [-1.0]]), torch.tensor([0, 2]), {"w": buf})
    g = torch.tensor([[-0.5], [1.0]])
    b = buf[[0, 2]] * 0.9 + g
    assert torch.equal(change[[0, 2]], -0.7 * (g + 0.9 * b)) and change[1].item() == 0.0
    assert torch.equal(state["w"][[0, 2]], b) and state["w"][1].item() == 2.0


def test_fedadam_keeps_two_moments_per_tensor_beside_the_global_exact(tmp_path, data):
    """A method with two state tensors per parameter (FedAdam) runs through the unchanged aggregator: every
    tensor is prev + Adam's step on the nodes' mean delta, its moments and step stored in outer.safetensors
    and taken up again the next round."""
    from spes.run.layout import OUTER_FILE
    from spes.sync.fedadam import OuterAdam

    p = make_params(tmp_path)
    p.sync.method, p.outer.lr = "fedadam", 0.01
    run = start(p)
    adam, state = OuterAdam(0.01, 0.9, 0.99, 1e-3), {}
    for r in (1, 2):
        do_round(p, run, data, r)
        ups = [run.store.read_bundle(run.layout.node_dir(r, i)).files[SHARED_FILE] for i in (0, 1)]
        prev, new = _global(run, r - 1), _global(run, r)
        outer = run.store.read_bundle(run.layout.global_dir(r)).files[OUTER_FILE]
        assert sorted(outer) == sorted(f"{n}#{k}" for n in new for k in ("exp_avg", "exp_avg_sq", "step"))
        for name, t in new.items():
            mean = weighted_sum([ups[0][name], ups[1][name]], [0.5, 0.5])
            change, kept = adam.step(name, mean, {k: v for k, v in state.items() if k.startswith(name + "#")})
            state.update(kept)
            assert torch.equal(t, prev[name] + change), name
            assert all(torch.equal(outer[k], v) for k, v in kept.items()), name
    assert run.global_meta(2).method == "fedadam" and outer[f"{name}#step"].item() == 2


def test_a_retried_node_round_is_idempotent(tmp_path, data):
    p = make_params(tmp_path)
    run = start(p)
    first = NodeRound(RoundContext.build(p, "r", run.store), 1, 0, data).run()
    before = run.store.read_manifest(run.layout.node_dir(1, 0))
    again = NodeRound(RoundContext.build(p, "r", run.store), 1, 0, data).run()
    assert run.store.read_manifest(run.layout.node_dir(1, 0)) == before  # not recomputed, not rewritten
    assert again.upload == first.upload and again.bytes_up == first.bytes_up


def test_quorum_and_a_node_that_misses_a_round(tmp_path, data):
    p = make_params(tmp_path)
    run = start(p)
    do_round(p, run, data, 1)
    NodeRound(RoundContext.build(p, "r", run.store), 2, 0, data).run()
    with pytest.raises(QuorumError, match=r"round 2: only nodes \[0\] committed, quorum is 2 of 2"):
        aggregate_round(RoundContext.build(p, "r", run.store), 2)
    agg = aggregate_round(RoundContext.build(p, "r", run.store), 2, min_nodes=1)
    assert (agg.contributors, agg.missing) == ([0], [1])
    assert agg.node_states[1].round == 1  # node 1 continues from its round-1 state
    g1, g2 = _global(run, 1), _global(run, 2)
    if not agg.merged:
        assert torch.equal(g2["model.layers.0.mlp.experts.down_proj"][2:], g1["model.layers.0.mlp.experts.down_proj"][2:])
    metas, agg3 = do_round(p, run, data, 3)
    assert agg3.contributors == [0, 1] and metas[1].upload.state.round == 3


def _reference(tmp_path, data, rounds=3, **kw):
    p = make_params(tmp_path, name="ref", **kw)
    run = start(p)
    for r in range(1, rounds + 1):
        do_round(p, run, data, r)
    return run.store.read_manifest(run.layout.global_dir(rounds))["files"][MODEL_FILE]["sha256"]


def test_a_corrupt_committed_upload_is_that_nodes_failure(tmp_path, data):
    p = make_params(tmp_path)
    run = start(p)
    do_round(p, run, data, 1)
    for i in (0, 1):
        NodeRound(RoundContext.build(p, "r", run.store), 2, i, data).run()
    f = tmp_path / "s-storage/runs/r/rounds/000002/nodes/000/shared.safetensors"
    f.write_bytes(f.read_bytes()[:-100])  # truncated after its commit
    with pytest.raises(UploadsRejected, match="node 0: .*nodes/000/shared.safetensors: (truncated|sha256/size)"):
        aggregate_round(RoundContext.build(p, "r", run.store), 2, rerun_rejected=True)
    assert not run.store.exists(run.layout.node_dir(2, 0))  # set aside, so the node can run the round again
    assert run.store.list_names("runs/r/rejected")[0].startswith("000002-000-")
    NodeRound(RoundContext.build(p, "r", run.store), 2, 0, data).run()  # re-run from its round-1 state: the same upload
    aggregate_round(RoundContext.build(p, "r", run.store), 2, rerun_rejected=True)
    do_round(p, run, data, 3)
    assert run.store.read_manifest(run.layout.global_dir(3))["files"][MODEL_FILE]["sha256"] == _reference(tmp_path, data)


@pytest.mark.parametrize("poison,ratio,why", [
    ({"nan": True}, None, r"shared.safetensors: .* decodes to non-finite values \(NaN or inf\)"),
    ({"nan": True, "fname": EXPERTS_FILE}, None, r"experts.safetensors: .* decodes to non-finite values"),
    ({"scale": 1000.0}, 100.0, r"its delta of .* has norm .*, [0-9.]+x the other nodes' median .*"
                               r"\(sync.max_delta_norm_ratio 100\)"),
])
def test_an_upload_whose_values_do_not_fit_is_set_aside_and_rerun(tmp_path, data, poison, ratio, why):
    """Bytes that verify (manifest and COMMIT made to match) but values that do not: a NaN-filled delta, or
    one a thousand times the other node's with sync.max_delta_norm_ratio set. The aggregator sets it aside
    naming the node, the round and the reason; the node re-runs the round and the run ends bitwise equal."""
    from pipelines.faults import poison_upload

    p = make_params(tmp_path, max_delta_norm_ratio=ratio)
    run = start(p)
    do_round(p, run, data, 1)
    for i in (0, 1):
        NodeRound(RoundContext.build(p, "r", run.store), 2, i, data).run()
    poison_upload(str(tmp_path / "s-storage/runs/r/rounds/000002/nodes/000"), poison.get("scale", 1.0),
                  poison.get("nan", False), poison.get("fname"))
    with pytest.raises(UploadsRejected, match="node 0: .*nodes/000.*" + why):
        aggregate_round(RoundContext.build(p, "r", run.store), 2, rerun_rejected=True)
    NodeRound(RoundContext.build(p, "r", run.store), 2, 0, data).run()
    aggregate_round(RoundContext.build(p, "r", run.store), 2, rerun_rejected=True)
    do_round(p, run, data, 3)
    assert run.store.read_manifest(run.layout.global_dir(3))["files"][MODEL_FILE]["sha256"] == _reference(tmp_path, data)


def test_a_scaled_upload_is_averaged_in_when_no_bound_is_set(tmp_path, data):
    """sync.max_delta_norm_ratio is off by default: a large but finite delta is the node's to make."""
    from pipelines.faults import poison_upload

    p = make_params(tmp_path)
    run = start(p)
    for i in (0, 1):
        NodeRound(RoundContext.build(p, "r", run.store), 1, i, data).run()
    poison_upload(str(tmp_path / "s-storage/runs/r/rounds/000001/nodes/001"), 1000.0, False)
    assert aggregate_round(RoundContext.build(p, "r", run.store), 1).contributors == [0, 1]


def test_the_norm_bound_compares_each_node_with_the_median_of_the_others():
    """Norms 1, 2, 3 and 40 (4 nodes, bound 10): 40 > 10 x median(1, 2, 3) = 20, set aside; 3 < 10 x
    median(1, 2, 40) = 20, kept. With three nodes at 1, 1 and 10 and bound 9.5, 10 > 9.5 x 1: set aside."""
    from spes.round.uploads import BadUpload, check_norms

    def check(norms, k):
        deltas = {i: torch.tensor([n, 0.0]) for i, n in enumerate(norms)}
        try:
            check_norms("w", deltas, k, {i: f"mem/rounds/2/nodes/{i}" for i in deltas})
        except BadUpload as e:
            return e.node, e.msg
        return None

    node, msg = check([1.0, 2.0, 3.0, 40.0], 10.0)
    assert node == 3 and "norm 40, 20.0x the other nodes' median 2" in msg
    assert check([1.0, 2.0, 3.0, 19.0], 10.0) is None
    assert check([1.0, 1.0, 10.0], 9.5)[0] == 2 and check([1.0, 1.0, 10.0], 10.0) is None
    assert check([0.0, 0.0, 5.0], 10.0) is None  # others unchanged (median 0): no judgement
    assert check([1.0, 1000.0], None) is None  # off


def test_a_corrupt_upload_is_left_out_under_the_quorum(tmp_path, data):
    p = make_params(tmp_path)
    run = start(p)
    NodeRound(RoundContext.build(p, "r", run.store), 1, 0, data).run()
    NodeRound(RoundContext.build(p, "r", run.store), 1, 1, data).run()
    m = tmp_path / "s-storage/runs/r/rounds/000001/nodes/001/experts.safetensors"
    m.write_bytes(m.read_bytes()[:-1] + b"\x00")
    agg = aggregate_round(RoundContext.build(p, "r", run.store), 1, min_nodes=1)
    assert agg.contributors == [0] and "experts.safetensors" in agg.rejected[1]


def test_a_delta_against_another_base_is_rejected(tmp_path, data):
    p = make_params(tmp_path)
    run = start(p)
    do_round(p, run, data, 1)
    NodeRound(RoundContext.build(p, "r", run.store), 2, 0, data).run()
    b = run.store.read_bundle(run.layout.node_dir(2, 0))
    run.store.remove(run.layout.node_dir(2, 0))
    run.store.write_bundle(run.layout.node_dir(2, 0), b.files, {**b.meta, "base_round": 0,
                                                                  "base_sha256": "f" * 64})
    with pytest.raises(UploadsRejected, match="its delta is against global 0 \\(ffffffffffff\\), not the committed global 1"):
        aggregate_round(RoundContext.build(p, "r", run.store), 2, rerun_rejected=True)


def test_node_state_is_the_one_the_global_was_built_with(tmp_path, data):
    """Silent divergence is impossible: a node whose recorded state is gone fails, naming it; with the state
    checkpointed on shared storage it continues, and the result is bitwise the uninterrupted one."""
    p = make_params(tmp_path)
    run = start(p)
    do_round(p, run, data, 1)
    for i in (0, 1):
        NodeRound(RoundContext.build(p, "r", run.store), 2, i, data, checkpoint=True).run()
    aggregate_round(RoundContext.build(p, "r", run.store), 2)
    local = NodeStateDir(node_state_root(p), run.store.location, "r", run.info()["run_id"], 0)
    local.local.remove("rounds/000002")  # the node's own copy is lost: the checkpoint serves
    do_round(p, run, data, 3)
    assert run.store.read_manifest(run.layout.global_dir(3))["files"][MODEL_FILE]["sha256"] == _reference(tmp_path, data)
    local.local.remove("rounds/000003")  # round 3 was no checkpoint round: nothing to fall back to
    with pytest.raises(NodeStateError, match=r"node 0: its state after round 3 .* round 3 is no checkpoint round"):
        NodeRound(RoundContext.build(p, "r", run.store), 4, 0, data).run()
    assert not run.store.exists(run.layout.node_dir(4, 0))

    # its machine lost, node 0 may continue elsewhere from its latest checkpoint (round 2), saying so
    from spes.round.inputs import read_inputs

    inputs = read_inputs(RoundContext.build(p, "r", run.store), 4, 0, from_checkpoint=True)
    assert (inputs.state.round, inputs.state.digest) == (2, run.global_meta(2).node_states[0].digest)
    assert inputs.state.source.startswith(run.store.url) and inputs.prev_sha == \
        run.store.read_manifest(run.layout.global_dir(3))["files"][MODEL_FILE]["sha256"]  # the model: global 3
    assert read_inputs(RoundContext.build(p, "r", run.store), 4, 1, from_checkpoint=True).state.round == 3  # node 1 has its own
    assert run.last_checkpointed_state(0, 1) == (0, None)  # before any checkpoint: a fresh state
    NodeRound(RoundContext.build(p, "r", run.store), 4, 0, data, from_checkpoint=True).run()
    assert run.store.exists(run.layout.node_dir(4, 0))


def test_non_finite_loss_stops_the_node_and_commits_nothing(tmp_path, data):
    p = make_params(tmp_path)
    p.train.optim.lr, p.train.optim.grad_clip, p.train.optim.warmup_steps = 1e6, 0.0, 0
    p.sync.every_steps = 6
    run = start(p)
    with pytest.raises(NonFiniteLoss, match=r"node 0 round 1: (loss is nan at step \d|.* is not finite after step 5)"):
        NodeRound(RoundContext.build(p, "r", run.store), 1, 0, data).run()
    assert not run.store.exists(run.layout.node_dir(1, 0))


def test_loss_settings_come_from_the_runs_params_not_round_zeros_config(tmp_path, data):
    """A variant's loss coefficients take effect (the architecture comes from the run's model, the training
    settings from its params): z-loss coefficients of 0.5 give another upload than the default."""
    shas = []
    for name, coef in (("a", None), ("b", 0.5)):
        p = make_params(tmp_path, name=name)
        run = start(p)  # round 0 records the default coefficients
        if coef is not None:
            p.model.z_loss_coef = p.model.lm_head_z_loss_coef = coef
        NodeRound(RoundContext.build(p, "r", run.store), 1, 0, data).run()
        shas.append(run.store.read_manifest(run.layout.node_dir(1, 0))["files"]["shared.safetensors"]["sha256"])
    assert shas[0] != shas[1]


def test_a_finished_run_keeps_on_the_node_machine_only_what_a_resume_needs(tmp_path, data):
    import os

    from spes.run.local_runs import forget_finished_run

    p = make_params(tmp_path)
    p.sync.rounds = 2
    store = Store.from_config(p.storage)
    runs = {}
    for name in ("done", "open", "next"):
        torch.manual_seed(0)
        runs[name] = Run(store, name)
        runs[name].ensure(settings_fingerprint(p), InitModel.from_state(CausalLM(p.model).canonical_state_dict(),
                                                                        p.model, "x"))
    for r in (1, 2):  # "done" to its end (its last round checkpointed, as the flow does); "open" one round
        for name in ("done", "open")[:1 if r == 2 else 2]:
            for i in (0, 1):
                NodeRound(RoundContext.build(p, name, store), r, i, data, checkpoint=name == "done" and r == 2).run()
            aggregate_round(RoundContext.build(p, name, store), r)
    folder = os.path.join(node_state_root(p), os.listdir(node_state_root(p))[0])

    def held():
        return {n.rsplit("-", 1)[0]: {d: sorted(os.listdir(os.path.join(folder, n, d)))
                                      for d in sorted(os.listdir(os.path.join(folder, n)))}
                for n in os.listdir(folder) if n != "LOCATION"}

    assert held()["done"] == {"node-000": ["base", "rounds"], "node-001": ["base", "rounds"]}
    assert open(os.path.join(folder, "LOCATION")).read() == f"{store.location}\n"  # which storage, for a person
    assert forget_finished_run(p, store, "open", 0) is None  # not finished: kept whole
    # finished: global 1 (still on storage) was built with round 1's states, which only the nodes hold
    assert forget_finished_run(p, store, "done", 1).endswith("node-001")
    d1 = NodeStateDir(node_state_root(p), store.location, "done", runs["done"].info()["run_id"], 1)
    assert d1.local.list_names("rounds") == ["000001"] and d1.base() is None
    assert forget_finished_run(p, store, "done", 1) is None  # nothing more to drop
    # once retention lets global 1 go, nothing local is needed: node 0's first round of another run on this
    # machine removes the finished run's folder for node 0
    assert runs["done"].retire(2, 1) == [1]
    NodeRound(RoundContext.build(p, "next", store), 1, 0, data).run()
    assert held() == {"done": {"node-001": ["rounds"]}, "open": {"node-000": ["base", "rounds"],
                      "node-001": ["base", "rounds"]}, "next": {"node-000": ["base", "rounds"]}}
    assert forget_finished_run(p, store, "done", 1).endswith("node-001")
    assert "done" not in held()


def test_averaged_optimizer_state_is_the_weighted_mean_of_the_nodes_moments(tmp_path, data):
    """sync.average_optimizer_state: global 1 holds the mean of the two nodes' Adam moments of the shared
    parameters (not of their experts), and each node's round 2 starts from it (its step count its own)."""
    from spes.round.inputs import read_inputs
    from spes.sync.deltas import MOMENTS_FILE

    p = make_params(tmp_path, average_optimizer_state=True)
    run = start(p)
    do_round(p, run, data, 1)
    ups = [run.store.read_bundle(run.layout.node_dir(1, i)).files[MOMENTS_FILE] for i in (0, 1)]
    mean = run.store.read_bundle(run.layout.global_dir(1)).files[MOMENTS_FILE]
    assert set(mean) == set(ups[0]) == set(ups[1]) and "model.norm.weight::exp_avg_sq" in mean
    assert not any(".experts." in k or k.endswith("::step") for k in mean)
    for k, t in mean.items():
        assert torch.equal(t, weighted_sum([ups[0][k], ups[1][k]], [0.5, 0.5])), k
        assert not torch.equal(ups[0][k], ups[1][k])
    for i in (0, 1):
        optim = read_inputs(RoundContext.build(p, "r", run.store), 2, i).state.optim
        assert all(torch.equal(optim[k], mean[k]) for k in mean)
        assert any(".experts." in k for k in optim)  # its own experts keep their own moments
    plain = make_params(tmp_path, name="plain")
    run2 = start(plain)
    do_round(plain, run2, data, 1)
    assert MOMENTS_FILE not in run2.store.read_manifest(run2.layout.global_dir(1))["files"]
    assert run2.store.read_bundle(run2.layout.global_dir(1)).files[MODEL_FILE].keys() == \
        run.store.read_bundle(run.layout.global_dir(1)).files[MODEL_FILE].keys()


def test_a_node_times_its_download_and_its_upload_apart_from_its_compute(tmp_path, data):
    """What a slow link costs a round shows in the record: reading the inputs and writing the upload's files
    are timed apart from the steps (bench/wan_round.py splits a round's wall time by them)."""
    import time

    p = make_params(tmp_path)
    run = start(p)
    t = time.perf_counter()
    (meta, _), _ = do_round(p, run, data, 1)
    wall = time.perf_counter() - t
    up = meta.upload
    assert 0 < up.seconds_read and 0 < up.seconds_upload and 0 < up.seconds_compute
    assert up.seconds_read + up.seconds_load + up.seconds_compute + up.seconds_upload < wall
    again = node_report(run.store.read_manifest(run.layout.node_dir(1, 0)), "x").upload
    assert (again.seconds_read, again.seconds_upload) == (up.seconds_read, up.seconds_upload)


def test_a_node_reads_each_manifest_once_per_round(tmp_path, data, monkeypatch):
    """The node's round reads every manifest it needs once: the run's info, global r-1, delta r-1 (shared
    storage), the global it holds and its state (its own machine); the bundles read after them reuse them."""
    from collections import Counter

    p = make_params(tmp_path)
    run = start(p)
    reads: Counter = Counter()
    read_manifest = Store.read_manifest

    def counted(self, rel):
        reads[(self.url, rel)] += 1
        return read_manifest(self, rel)

    monkeypatch.setattr(Store, "read_manifest", counted)
    for r in (1, 2, 3):
        reads.clear()
        NodeRound(RoundContext.build(p, "r", run.store), r, 0, data).run()
        assert reads and max(reads.values()) == 1, (r, reads)
        NodeRound(RoundContext.build(p, "r", run.store), r, 1, data).run()
        aggregate_round(RoundContext.build(p, "r", run.store), r)
    assert {rel for _, rel in reads} >= {"base", "rounds/000002", "runs/r/rounds/000002/delta"}  # round 3's
