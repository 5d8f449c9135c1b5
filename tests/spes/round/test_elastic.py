"""Elastic ownership as library rounds (no Prefect): a node evicted after missing rounds, a node joining,
every expert with exactly one owner in every round, no expert's committed value lost, and a resume across a
membership change equal to the uninterrupted run."""
import pytest
import torch

from spes.config.ownership import check_owners
from spes.config.schema import Params
from spes.data.tokens import TokenData
from spes.errors import MembershipError
from spes.round.aggregator import aggregate_round
from spes.round.context import RoundContext
from spes.round.node import NodeRound
from spes.run.layout import MODEL_FILE
from spes.run.membership import request
from spes.sync.methods import sync_method
from tests.conftest import start_run, tiny_params

E = 6
EXPERT = "model.layers.0.mlp.experts.down_proj"


def _params(tmp_path, name) -> Params:
    p = tiny_params(vocab_size=512, num_experts=E)
    s = p.sync
    s.num_nodes, s.every_steps, s.rounds, s.warmup_rounds, p.train.batch_size, p.train.seq_len = 3, 2, 5, 0, 2, 16
    p.merge.enabled = False
    p.dense.seq_len = p.eval.seq_len = 16
    p.storage.url, p.orchestration.device = str(tmp_path / f"{name}-storage"), "cpu"
    p.orchestration.node_state_dir = str(tmp_path / f"{name}-nodes")
    p.orchestration.evict_after_rounds, p.orchestration.min_nodes = 1, 2
    p.checkpoint.every_rounds = 100
    return p


_start = start_run


def _round(p, run, data, r, nodes):
    reports = {i: NodeRound(RoundContext.build(p, "r", run.store), r, i, data, checkpoint=r == 2).run() for i in nodes}
    return reports, aggregate_round(RoundContext.build(p, "r", run.store), r, min_nodes=2)


def _nodes(r):
    """Node 2 is gone for good from round 3; node 7 joins (asked during round 3), from round 4 on."""
    return [0, 1, 2] if r < 3 else [0, 1] if r == 3 else [0, 1, 7]


def _play(p, run, data, rounds):
    for r in rounds:
        if r == 3 and not run.store.list_names(run.layout.membership_dir):
            request(run.store, "r", sync_method(p), "join", 7)
        _round(p, run, data, r, _nodes(r))


@pytest.fixture(scope="module")
def data(tiny_tokens):
    return TokenData.open(tiny_tokens)


def _glob(run, r):
    return run.store.read_bundle(run.layout.global_dir(r)).files[MODEL_FILE]


def test_an_evicted_nodes_experts_are_trained_by_the_survivors_and_a_joiner_contributes(tmp_path, data):
    p = _params(tmp_path, "a")
    run = _start(p)
    _play(p, run, data, [1, 2, 3, 4, 5])
    m = {r: run.global_meta(r) for r in range(1, 6)}
    assert m[2].membership.owners == {0: [0, 1], 1: [2, 3], 2: [4, 5]}
    # global 3: node 2 missed round 3 and is evicted (its experts 4, 5 to nodes 0, 1), then node 7 joins and
    # takes the most loaded members' highest experts, reading node 2's data slot
    assert m[3].contributors == [0, 1] and m[3].missing == [2]
    assert m[3].membership.owners == {0: [0, 1], 1: [2, 3], 7: [4, 5]}
    assert m[3].membership.slots == {0: 0, 1: 1, 7: 2}
    assert 2 not in m[3].node_states
    assert any("node 2 evicted (missed 1 rounds in a row)" in c for c in m[3].membership_changes)
    assert any("node 7 joined (data slot 2)" in c for c in m[3].membership_changes)
    assert m[4].contributors == [0, 1, 7] and m[5].contributors == [0, 1, 7] and m[5].membership_changes == []
    for r in range(1, 6):  # every expert has exactly one owner in every round
        check_owners({n: tuple(e) for n, e in m[r].membership.owners.items()}, E)
    g = {r: _glob(run, r) for r in range(1, 6)}
    # round 3: nobody trained experts 4, 5: their last committed value is kept
    assert torch.equal(g[3][EXPERT][4:], g[2][EXPERT][4:]) and not torch.equal(g[3][EXPERT][:4], g[2][EXPERT][:4])
    # round 4: the joiner trained them from that value: global 3 + its upload, exactly
    up = run.store.read_bundle(run.layout.node_dir(4, 7)).files["experts.safetensors"]
    assert torch.equal(g[4][EXPERT][4:], g[3][EXPERT][4:] + up[EXPERT])
    assert run.store.read_manifest(run.layout.node_dir(4, 7))["meta"]["experts"] == [4, 5]
    with pytest.raises(MembershipError, match=r"node 2 is not a member of run 'r' in round 6 \(members \[0, 1, 7\]\)"):
        NodeRound(RoundContext.build(p, "r", run.store), 6, 2, data).run()


def test_a_resume_across_a_membership_change_equals_the_uninterrupted_run(tmp_path, data):
    a, b = _params(tmp_path, "a"), _params(tmp_path, "b")
    run_a, run_b = _start(a), _start(b)
    _play(a, run_a, data, [1, 2, 3, 4, 5])
    _play(b, run_b, data, [1, 2, 3, 4])
    assert run_b.resolve_start(2) == 3  # rounds 3, 4 (and the change at 3) set aside, recomputed
    assert run_b.store.list_names(run_b.layout.membership_dir) == ["join-00007.json"]  # stamped: applied at 3 again
    _play(b, run_b, data, [3, 4, 5])
    for r in (3, 4, 5):
        assert run_b.global_meta(r).membership == run_a.global_meta(r).membership
        sha = [x.store.read_manifest(x.layout.global_dir(r))["files"][MODEL_FILE]["sha256"] for x in (run_a, run_b)]
        assert sha[0] == sha[1], r


def test_requests_that_cannot_be_are_refused_with_nothing_written(tmp_path, data):
    p = _params(tmp_path, "a")
    run = _start(p)
    method = sync_method(p)
    with pytest.raises(MembershipError, match=r"node 1 is already a member of run 'r' \(members after round 0: \[0, 1, 2\]\)"):
        request(run.store, "r", method, "join", 1)
    with pytest.raises(MembershipError, match="node 5 is not a member of run 'r'"):
        request(run.store, "r", method, "leave", 5)
    assert run.store.list_names(run.layout.membership_dir) == []
    with pytest.raises(MembershipError, match=r"node 0 leaving run 'r' would leave 2 members, below "
                                              r"orchestration.min_nodes=3"):  # never lowers the quorum silently
        request(run.store, "r", method, "leave", 0, min_nodes=3)
    assert run.store.list_names(run.layout.membership_dir) == []
    request(run.store, "r", method, "leave", 0, min_nodes=2)
    with pytest.raises(MembershipError, match="a leave request of run 'r' is already pending"):
        request(run.store, "r", method, "leave", 0)
    request(run.store, "r", method, "leave", 1)
    with pytest.raises(MembershipError, match="node 2 is the last member of run 'r'"):
        request(run.store, "r", method, "leave", 2)
    _round(p, run, data, 1, [0, 1, 2])
    m = run.global_meta(1)
    assert m.membership.owners == {2: [0, 1, 2, 3, 4, 5]} and m.contributors == [0, 1, 2]
    assert sorted(run.store.list_names(run.layout.membership_dir)) == ["leave-00000.json", "leave-00001.json"]
    with pytest.raises(MembershipError, match="not a member"):
        NodeRound(RoundContext.build(p, "r", run.store), 2, 0, data).run()
