"""sync.overlap one_round as library calls (no Prefect): where a round starts from, what it uploads, what it keeps,
and a resume on another machine that ends bitwise equal to the uninterrupted overlapped run."""
import contextlib
import shutil

import pytest
import torch

from spes.data.tokens import TokenData
from spes.errors import ConfigError, NodeStateError
from spes.round import aggregator as aggregator_module
from spes.round import inputs as inputs_module
from spes.round import lookahead as lookahead_module
from spes.round import node as node_module
from spes.round.aggregator import aggregate_round
from spes.round.context import RoundContext
from spes.round.lookahead import Lookahead
from spes.round.node import NodeRound
from spes.run.identity import settings_fingerprint
from spes.run.layout import MODEL_FILE
from spes.run.local_runs import node_state_root
from spes.run.node_state import NodeStateDir
from spes.sync.deltas import EXPERTS_FILE, SHARED_FILE, with_own_delta
from spes.sync.methods import sync_method
from tests.conftest import params_of
from tests.spes.round.test_round import _global, make_params, start

EXPERT = "model.layers.0.mlp.experts.down_proj"


@pytest.fixture(scope="module")
def data(tiny_tokens):
    return TokenData.open(tiny_tokens)


def _sha(run, r):
    return run.store.read_manifest(run.layout.global_dir(r))["files"][MODEL_FILE]["sha256"]


def _rounds(p, run, data, rounds, checkpoint_at=(), retain=True):
    for r in rounds:
        for i in (0, 1):
            NodeRound(RoundContext.build(p, "r", run.store), r, i, data, checkpoint=r in checkpoint_at).run()
        aggregate_round(RoundContext.build(p, "r", run.store), r)
        if retain:
            run.retire(r, p.storage.keep_rounds, None, p.sync.overlap != "none")


def _state(p, run, r, node):
    local = NodeStateDir(node_state_root(p), run.store.location, "r", run.info()["run_id"], node)
    return local.load_state(run.global_meta(r).node_states[node], run.store, run.layout.state_dir(r, node))


def test_a_round_starts_from_the_nodes_own_model_and_uploads_only_what_it_trained(tmp_path, data, monkeypatch):
    p = make_params(tmp_path, overlap="one_round")
    run = start(p)
    starts, real = {}, node_module.train

    def spy(local, begin, *a, **kw):
        starts[local.r, local.node] = {n: t.clone() for n, t in begin.model.items()}
        return real(local, begin, *a, **kw)

    monkeypatch.setattr(node_module, "train", spy)  # a round asked for
    monkeypatch.setattr(lookahead_module, "train", spy)  # a round trained ahead
    _rounds(p, run, data, (1, 2, 3), retain=False)
    method, g = sync_method(p), {r: _global(run, r) for r in (0, 1, 2)}
    s1, s2 = _state(p, run, 1, 0), _state(p, run, 2, 0)
    assert all(torch.equal(starts[1, 0][n], g[0][n]) for n in g[0])  # round 1: from global 0, as without overlap
    assert s1.sent_base == (0, _sha(run, 0)) and s2.sent_base == (1, _sha(run, 1))
    own = (0, 1)  # node 0's experts of the 4
    for r, base, sent in ((2, g[0], s1.sent), (3, g[1], s2.sent)):  # global r-2 + its own delta of round r-1
        want = with_own_delta(method, base, sent, own)
        assert all(torch.equal(starts[r, 0][n], want[n]) for n in want), r
    # round 2 began before global 1 existed: node 1's experts are global 0's there, not node 1's round-1 update
    assert torch.equal(starts[2, 0][EXPERT][2:], g[0][EXPERT][2:]) and not torch.equal(g[1][EXPERT][2:], g[0][EXPERT][2:])
    # and global 1 came in at the end of round 2: round 3 starts with node 1's experts as committed in global 1
    assert torch.equal(starts[3, 0][EXPERT][2:], g[1][EXPERT][2:])
    # the upload of round 2 (fp32: exact) is what the node trained in round 2 and nothing else
    up = run.store.read_bundle(run.layout.node_dir(2, 0)).files
    assert all(torch.equal({**up[SHARED_FILE], **up[EXPERTS_FILE]}[n], s2.sent[n]) for n in s2.sent)


def test_overlap_is_part_of_the_runs_maths():
    none, one = params_of(), params_of("sync.overlap=one_round")
    assert settings_fingerprint(none) != settings_fingerprint(one)
    assert settings_fingerprint(none) == settings_fingerprint(params_of("sync.overlap=none"))
    with pytest.raises(ConfigError, match="sync.overlap must be one of none|one_round"):
        params_of("sync.overlap=two_rounds")
    with pytest.raises(ConfigError, match="average_optimizer_state"):
        params_of("sync.overlap=one_round", "sync.average_optimizer_state=true")
    with pytest.raises(ConfigError, match="storage.keep_rounds must be >= 2"):
        params_of("sync.overlap=one_round", "storage.keep_rounds=1")


def test_round_one_is_the_same_and_later_rounds_differ_from_no_overlap(tmp_path, data):
    runs = {}
    for overlap in ("none", "one_round"):
        p = make_params(tmp_path, name=overlap, overlap=overlap)
        runs[overlap] = start(p)
        _rounds(p, runs[overlap], data, (1, 2))
    assert _sha(runs["none"], 1) == _sha(runs["one_round"], 1)
    assert _sha(runs["none"], 2) != _sha(runs["one_round"], 2)


def test_a_resume_on_another_machine_is_bitwise_and_retention_keeps_the_global_it_needs(tmp_path, data):
    """int8 deltas with error feedback; round 2 checkpointed; the keep_rounds=2 window has moved past global 1
    (which the overlapped round 3 starts from) by the time the run is resumed after round 2 with no local state."""
    def overlapped(name):
        p = make_params(tmp_path, name=name, codec="int8", overlap="one_round", rounds=4)
        return p, start(p)

    ref_p, ref = overlapped("ref")
    _rounds(ref_p, ref, data, (1, 2, 3, 4), checkpoint_at=(2,))
    for keep_before in (True, False):
        p, run = overlapped(f"keep-{keep_before}")
        for r in (1, 2, 3):
            for i in (0, 1):
                NodeRound(RoundContext.build(p, "r", run.store), r, i, data, checkpoint=r == 2).run()
            aggregate_round(RoundContext.build(p, "r", run.store), r)
            run.retire(r, 2, None, keep_before)
        assert run.store.exists(run.layout.global_dir(1)) == keep_before
        run.supersede_after(2)
        shutil.rmtree(node_state_root(p))  # another machine: states from the round-2 checkpoint, no global held
        if keep_before:
            _rounds(p, run, data, (3, 4))
            assert _sha(run, 4) == _sha(ref, 4)
        else:  # without the retention rule the resume cannot start, and says why
            with pytest.raises(NodeStateError, match="starts it from global 1 plus its own delta of round 2"):
                NodeRound(RoundContext.build(p, "r", run.store), 3, 0, data).run()


def test_rounds_trained_ahead_give_the_same_bits_and_are_taken_only_for_the_inputs_they_assumed(tmp_path, data,
                                                                                             monkeypatch):
    """Node 1 trains each next round on a thread right after committing one; node 0 misses round 3, so global 3
    does not continue from its state of round 2 and what it trained ahead for round 3 is never taken (its round 4
    trains from what is committed). Both end bitwise equal to the same run with no thread."""
    trained, results, real = [], {}, node_module.train

    def spy(local, begin, *a, log_progress=True, **kw):
        trained.append((local.r, local.node, "ahead" if not log_progress else "asked"))
        out = real(local, begin, *a, log_progress=log_progress, **kw)
        results[local.r, local.node] = out
        return out

    monkeypatch.setattr(node_module, "train", spy)
    monkeypatch.setattr(lookahead_module, "train", spy)
    # the nodes share this test's process with the aggregator, whose one-thread section would change the
    # thread count (and so the float sums) of a round training ahead; a node process has no aggregator
    monkeypatch.setattr(aggregator_module, "one_torch_thread", contextlib.nullcontext)
    asked_fetch, real_fetch = [], inputs_module.fetch_global

    def counted_fetch(ctx, r, *a, **kw):  # the round's own read of global r-1 (not the prefetch's)
        asked_fetch.append(r + 1)
        return real_fetch(ctx, r, *a, **kw)

    monkeypatch.setattr(inputs_module, "fetch_global", counted_fetch)
    shas, down = {}, {}
    for mode in ("plain", "ahead"):
        p = make_params(tmp_path, name=mode, overlap="one_round")
        run = start(p)
        aheads = {i: Lookahead() if mode == "ahead" else None for i in (0, 1)}
        trained.clear()
        asked_fetch.clear()
        for r, nodes in ((1, (0, 1)), (2, (0, 1)), (3, (1,)), (4, (0, 1))):
            for i in nodes:
                rep = NodeRound(RoundContext.build(p, "r", run.store), r, i, data).run(aheads[i])
                down[mode, r, i] = rep.bytes_down
            aggregate_round(RoundContext.build(p, "r", run.store), r, min_nodes=1)
        shas[mode] = [_sha(run, r) for r in (1, 2, 3, 4)]
        if mode == "ahead":
            assert sorted(trained) == sorted([(1, 0, "asked"), (1, 1, "asked"), (2, 0, "ahead"), (2, 1, "ahead"),
                                              (3, 0, "ahead"), (3, 1, "ahead"), (4, 1, "ahead"), (4, 0, "asked")])
            # globals fetched while the next round trained: a round reads global r-1 itself only in round 1,
            # and node 0 in round 4 (its prefetch was of global 2; it missed round 3)
            assert sorted(asked_fetch) == [1, 1, 4]
            # every round is timed for its record (TensorBoard's tokens/s within it), trained ahead or not
            assert all(t.timeline and t.timeline[-1][0] == p.sync.every_steps for t in results.values())
            # a round's trainer let go of its memory once its results were copied out (node 1, rounds 1-3)
            assert all(p.is_meta for r in (1, 2, 3) for p in results[r, 1].trainer.model.parameters())
    assert shas["plain"] == shas["ahead"]
    # the prefetch's bytes count in the round that uses them (manifests differ by their timings' digits); node 0
    # in round 4 holds global 2 here (its prefetch kept it), global 1 without threads: it reads less
    same = [(r, i) for (mode, r, i) in down if mode == "plain" and (r, i) != (4, 0)]
    assert all(abs(down["plain", r, i] - down["ahead", r, i]) < 400 for r, i in same), sorted(down.items())
    assert down["ahead", 4, 0] < down["plain", 4, 0]
