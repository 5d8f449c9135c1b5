"""The round driver: the real round (nodes, aggregation, record, retention) as the flow, tests and benches run it."""
import pytest

from spes.config.schema import Params
from spes.data.tokens import TokenData
from spes.errors import QuorumError
from spes.round.aggregator import Aggregator
from spes.round.context import RoundContext
from spes.round.driver import HeldOutProbe, checkpoint_due, run_round
from spes.round.node import NodeRound
from spes.run.identity import settings_fingerprint
from spes.run.records import NodeReport
from tests.conftest import start_run, tiny_params


def _params(tmp_path, **sync) -> Params:
    p = tiny_params(vocab_size=512)
    s = p.sync
    s.num_nodes, s.every_steps, p.train.batch_size, p.train.seq_len, s.rounds, s.warmup_rounds = 2, 1, 1, 16, 50, 0
    p.merge.enabled = False
    for k, v in sync.items():
        setattr(s, k, v)
    p.dense.seq_len = p.eval.seq_len = 16
    p.eval.round_batches, p.eval.batch_size = 1, 2
    p.storage.url, p.orchestration.device = str(tmp_path / "storage"), "cpu"
    p.orchestration.node_state_dir = str(tmp_path / "nodes")
    p.storage.keep_rounds, p.checkpoint.every_rounds, p.checkpoint.keep_last = 2, 5, None
    return p


_start = start_run


def _writer(p, run) -> RoundContext:
    """The flow's context: the driver and the aggregator share it (and the global manifests it keeps)."""
    return RoundContext.build(p, run.name, run.store, writer=True)


def _nodes(p, run, data, r):
    """The nodes, each with a context of its own, as a node process has."""
    def run_nodes(nodes, checkpoint):
        return {i: NodeRound(RoundContext.build(p, run.name, run.store), r, i, data, checkpoint=checkpoint).run()
                for i in nodes}

    return run_nodes


def round_one(p, run, data, heldout=None):
    """Round 1 through the driver, with the flow's context and aggregator; its record."""
    ctx = _writer(p, run)
    agg = Aggregator(ctx)
    return run_round(ctx, 1, _nodes(p, run, data, 1), lambda rerun: agg.aggregate(1, rerun_rejected=rerun),
                     checkpoint=False, heldout=heldout)


@pytest.fixture(scope="module")
def data(tiny_tokens):
    return TokenData.open(tiny_tokens)


@pytest.mark.slow
def test_storage_calls_per_round_do_not_grow_with_the_round_number(tmp_path, data):
    """Retention, the index of resumable rounds and the records touch a bounded set of rounds: round 30
    makes as many storage calls as round 5 (both checkpoint rounds, every checkpoint kept)."""
    p = _params(tmp_path, rounds=30)
    run = _start(p)
    ctx = _writer(p, run)
    agg = Aggregator(ctx)
    calls = {}
    for r in range(1, 31):
        before = run.store.calls
        rec = run_round(ctx, r, _nodes(p, run, data, r), lambda rerun, r=r: agg.aggregate(r, rerun_rejected=rerun),
                        checkpoint_due(p, r, 30))
        calls[r] = run.store.calls - before
        assert rec.aggregate.contributors == [0, 1]
    print("storage calls per round:", calls)
    assert abs(calls[30] - calls[5]) <= 0.1 * calls[5], (calls[5], calls[30])
    assert abs(calls[29] - calls[9]) <= 0.1 * calls[9], (calls[9], calls[29])
    assert run.index(30).storage_resumable == [0] + list(range(5, 31, 5))
    assert run.committed_rounds() == [0] + list(range(5, 30, 5)) + [29, 30]  # window + checkpoint rounds


def test_a_round_records_what_happened_and_a_missing_quorum_names_the_cause(tmp_path, data):
    p = _params(tmp_path, rounds=2)
    run = _start(p)
    ctx = _writer(p, run)
    agg = Aggregator(ctx)
    rec = round_one(p, run, data, HeldOutProbe(p, data.folder))
    assert run.record(1) == rec and rec.heldout_loss is not None and rec.heldout_s > 0
    # each window of the round's slice kept (per-round paired differences: spes/eval/compare.py round_pairs)
    windows = rec.heldout_windows
    assert windows is not None and len(windows) == min(p.eval.round_batches * p.eval.batch_size,
                                                      (len(data.val) - 1) // p.eval.seq_len)
    assert sum(windows) / len(windows) == pytest.approx(rec.heldout_loss, abs=1e-12)
    assert rec.tokens == 2 * 16 and [n.node for n in rec.nodes] == [0, 1] and all(n.ok for n in rec.nodes)

    def one_fails(nodes, checkpoint):
        rows = _nodes(p, run, data, 2)([n for n in nodes if n != 1], checkpoint)
        return {**rows, 1: NodeReport(1, "failed", error="NonFiniteLoss: node 1 round 2: loss is nan at step 1")}

    with pytest.raises(QuorumError, match=r"only nodes \[0\] committed.*; node 1: failed \(NonFiniteLoss: node 1 round 2"):
        run_round(ctx, 2, one_fails, lambda rerun: agg.aggregate(2, rerun_rejected=rerun), checkpoint=False)


def test_an_extended_wsd_run_equals_one_that_had_that_many_rounds_from_the_start(tmp_path, data):
    """train.optim.schedule=wsd: more rounds keep the run (same fingerprint); the rounds that decayed under the
    old total are set aside and recomputed, and the result is bitwise the run that had that many rounds from
    the start. With cosine, the same change is another run (the error says so)."""
    from spes.errors import RunMismatch
    from spes.round.driver import resume_point
    from spes.run.layout import MODEL_FILE
    from spes.run.local_runs import node_state_root
    from spes.run.node_state import NodeStateDir

    def params(folder, rounds, schedule="wsd"):
        p = _params(tmp_path / folder, rounds=rounds, sync_steps=2)
        p.train.optim.schedule, p.train.optim.decay_fraction, p.train.optim.warmup_steps = schedule, 0.5, 1
        p.storage.keep_rounds = None  # rounds 1-2 stay whole (by default, a resume falls back to a checkpoint round)
        return p

    def rounds(p, run, first, last):
        ctx = _writer(p, run)
        agg = Aggregator(ctx)
        for r in range(first, last + 1):
            run_round(ctx, r, _nodes(p, run, data, r), lambda rerun, r=r: agg.aggregate(r, rerun_rejected=rerun),
                      checkpoint_due(p, r, last))

    def sha(run, r):
        return run.store.read_manifest(run.layout.global_dir(r))["files"][MODEL_FILE]["sha256"]

    p4 = params("a", 4)
    run = _start(p4)
    rounds(p4, run, 1, 4)
    p6 = params("a", 6)
    run.ensure(settings_fingerprint(p6), None)  # the same run
    info = run.info()

    def local(i, ref):
        return NodeStateDir(node_state_root(p6), run.store.location, "r", info["run_id"], i).has_state(ref)

    first = resume_point(p6, run, "latest", local)  # decay began at step 4 (old) and 6 (new): rounds 1-2 stay
    assert first == 3
    rounds(p6, run, 3, 6)
    ref = _start(params("b", 6))
    rounds(params("b", 6), ref, 1, 6)
    assert sha(run, 6) == sha(ref, 6)
    with pytest.raises(RunMismatch, match=r"sync.rounds: 4 -> 6.*with train.optim.schedule=wsd a run can be extended"):
        c4 = params("c", 4, "cosine")
        c = _start(c4)
        c.store.remove(c.layout.info)
        from spes.config.loader import to_dict
        from spes.run.identity import fingerprinted

        c.ensure(settings_fingerprint(c4), None, settings=fingerprinted(to_dict(c4)))
        c6 = params("c", 6, "cosine")
        c.ensure(settings_fingerprint(c6), None, settings=fingerprinted(to_dict(c6)))


def test_a_membership_plan_leaves_and_joins_at_its_rounds(tmp_path, data):
    """'leave 1 after 2': node 1's last round is 2; 'join 5 after 3': node 5 trains from round 4 on."""
    p = _params(tmp_path, num_nodes=2, rounds=5)
    p.orchestration.membership_plan = ["leave 1 after 2", "join 5 after 3"]
    run = _start(p)
    ctx = _writer(p, run)
    agg = Aggregator(ctx)
    seen = {}
    for r in range(1, 6):
        def run_nodes(nodes, checkpoint, r=r):
            seen[r] = list(nodes)
            return _nodes(p, run, data, r)(nodes, checkpoint)
        run_round(ctx, r, run_nodes, lambda rerun, r=r: agg.aggregate(r, None, rerun), False)
    assert seen == {1: [0, 1], 2: [0, 1], 3: [0], 4: [0, 5], 5: [0, 5]}
    assert run.global_meta(5).membership.owners == {0: [0, 1], 5: [2, 3]}
    assert run.global_meta(5).membership.slots == {0: 0, 5: 1}  # the leaver's data slot


def test_the_flow_reads_no_global_manifest_in_a_steady_round(tmp_path, data, monkeypatch):
    """The flow's context (the run's writer) keeps the globals it read or committed: in a steady round the
    driver (members), the aggregator (global r-1) and retention (global r's index and node states) read none
    from storage; the nodes, each with its own context, read global r-1 once each."""
    from collections import Counter

    from spes.errors import NotCommitted
    from spes.storage.store import Store

    p = _params(tmp_path, rounds=4)
    run = _start(p)
    flow = _writer(p, run)
    agg = Aggregator(flow)
    reads: Counter = Counter()
    read_manifest = Store.read_manifest

    def counted(self, rel):
        reads[("flow" if self is flow.store else "node", rel)] += 1
        return read_manifest(self, rel)

    def nodes(r):
        def run_nodes(members, checkpoint):
            store = Store.from_config(p.storage)  # a node process's own
            return {i: NodeRound(RoundContext.build(p, run.name, store), r, i, data).run() for i in members}
        return run_nodes

    monkeypatch.setattr(Store, "read_manifest", counted)
    for r in (1, 2, 3):
        reads.clear()
        run_round(flow, r, nodes(r), lambda rerun, r=r: agg.aggregate(r, rerun_rejected=rerun), False)
    flow_globals = {rel: n for (who, rel), n in reads.items() if who == "flow" and rel.endswith("/global")}
    assert flow_globals == {}, flow_globals
    assert reads[("node", "runs/r/rounds/000002/global")] == 2  # one read per node
    moved = run.supersede_after(2)  # another handle (another writer) moves round 3 aside ...
    assert moved == [3]
    flow.run.forget_globals()  # ... which the flow sees when it takes the lease
    with pytest.raises(NotCommitted, match="000003/global"):
        flow.run.global_manifest(3)


def test_a_writer_forgets_the_globals_it_moves_aside(tmp_path, data):
    from spes.errors import NotCommitted

    p = _params(tmp_path, rounds=2)
    run = _start(p)
    flow = _writer(p, run)
    run_round(flow, 1, _nodes(p, run, data, 1), lambda rerun: Aggregator(flow).aggregate(1, rerun_rejected=rerun),
              False)
    sha = flow.run.global_manifest(1)["files"]["model.safetensors"]["sha256"]
    assert flow.run.supersede_after(0) == [1]
    with pytest.raises(NotCommitted):  # not the manifest it kept
        flow.run.global_manifest(1)
    run_round(flow, 1, _nodes(p, run, data, 1), lambda rerun: Aggregator(flow).aggregate(1, rerun_rejected=rerun),
              False)  # recomputed: the same bits, read anew
    assert flow.run.global_manifest(1)["files"]["model.safetensors"]["sha256"] == sha
    assert flow.run.global_manifest(1)["written_at"] == run.global_manifest(1)["written_at"]
