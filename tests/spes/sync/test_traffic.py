"""The planner's bytes per round (spes/sync/traffic.py) against what real rounds move on a local store:
every tensor file exact, the totals (manifests' records estimated) within a fraction of a percent."""
import pytest

from spes.data.tokens import TokenData
from spes.round.aggregator import aggregate_round
from spes.round.context import RoundContext
from spes.round.node import NodeRound
from spes.sync.deltas import EXPERTS_FILE, SHARED_FILE
from spes.sync.methods import sync_method
from spes.sync.traffic import node_round_traffic
from tests.spes.round.test_round import make_params, start


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_the_planned_traffic_is_what_rounds_move(tmp_path, tiny_tokens, codec):
    p = make_params(tmp_path, codec=codec)  # experts merged at round 2 (step 4): round 3 downloads all of them
    run, data = start(p), TokenData.open(tiny_tokens)
    reports = {}
    for r in (1, 2, 3, 4):
        reports[r] = [NodeRound(RoundContext.build(p, "r", run.store), r, i, data).run() for i in (0, 1)]
        aggregate_round(RoundContext.build(p, "r", run.store), r)
    for r, kw in ((1, {"holds_previous": False}), (3, {"merging": True}), (4, {})):
        for rep in reports[r]:
            plan = node_round_traffic(p, sync_method(p), rep.node, **kw)
            files = run.store.read_manifest(run.layout.node_dir(r, rep.node))["files"]
            assert {f: e["bytes"] for f, e in files.items()} == \
                {f.removeprefix("upload "): b for f, b in plan.up.items() if f.endswith(".safetensors")}
            assert rep.bytes_up == pytest.approx(plan.up_bytes, rel=0.005)
            assert rep.bytes_down == pytest.approx(plan.down_bytes, rel=0.02 if r == 1 else 0.005), (r, plan.down)
    # a steady round's tensor downloads, file by file: the shared delta and the other owner's experts
    delta = run.store.read_manifest(run.layout.delta_dir(3))["files"]
    plan = node_round_traffic(p, sync_method(p), 0)
    other = run.store.read_manifest(run.layout.node_dir(3, 1))["files"][EXPERTS_FILE]["bytes"]
    assert (plan.down[f"delta {SHARED_FILE}"], plan.down[f"node 1 {EXPERTS_FILE}"]) == (delta[SHARED_FILE]["bytes"], other)
    assert "node 0 experts.safetensors" not in plan.down  # its own experts it holds


def test_a_full_model_method_moves_every_tensor_as_averaged():
    from tests.conftest import tiny_params

    p = tiny_params()
    p.sync.method = "diloco"
    t = node_round_traffic(p, sync_method(p), 0)
    assert sorted(f for f in t.up if f.endswith(".safetensors")) == ["upload shared.safetensors"]
    assert not [f for f in t.down if "experts" in f]
