"""Elastic ownership end to end (Prefect flow, process executor, tiny model): node 2 of 3 dies for good at
round 3 and is evicted; node 3 joins; the run finishes every round; a resume from before the change equals the
uninterrupted run bit for bit."""
import pytest
import torch

from spes.config.loader import load_params
from spes.config.ownership import check_owners
from spes.run.layout import MODEL_FILE
from spes.run.membership import request
from spes.run.run import Run
from spes.storage.store import Store
from spes.sync.methods import sync_method
from tests.pipelines.tiny_project import init_run, make_project

OVERRIDES = ["sync.num_nodes=3", "model.num_experts=6", "sync.rounds=5", "sync.warmup_rounds=2",
             "merge.enabled=false", "orchestration.min_nodes=2", "orchestration.evict_after_rounds=1",
             "orchestration.node_retries=0", "storage.keep_rounds=null"]
EXPERT = "model.layers.0.mlp.experts.down_proj"


@pytest.mark.slow
def test_a_dead_node_is_evicted_a_new_one_joins_and_a_resume_across_it_is_exact(tmp_path, tiny_tokens, prefect_server,
                                                                             monkeypatch):
    from pipelines.training import spes_training

    make_project(tmp_path, tiny_tokens)
    pfile = str(tmp_path / "params.yaml")
    init_run(pfile, "elastic", OVERRIDES)
    p = load_params(pfile, OVERRIDES)
    run = Run(Store.from_config(p.storage), "elastic")
    monkeypatch.setenv("SPES_FAULT_PLAN", '{"dead": {"node": 2, "from_round": 3}}')

    def train(**kw):
        return spes_training(params_path=pfile, overrides=OVERRIDES, run_name="elastic", **kw)

    assert train(stage="warmup")["rounds_run"] == [1, 2]
    request(run.store, "elastic", sync_method(p), "join", 3)  # applied at the end of round 3
    assert train()["rounds_run"] == [3, 4, 5]

    m = {r: run.global_meta(r) for r in range(1, 6)}
    assert [m[r].contributors for r in range(1, 6)] == [[0, 1, 2], [0, 1, 2], [0, 1], [0, 1, 3], [0, 1, 3]]
    assert m[3].membership.owners == {0: [0, 1], 1: [2, 3], 3: [4, 5]}
    for r in range(1, 6):  # every expert has exactly one owner in every round
        check_owners({n: tuple(e) for n, e in m[r].membership.owners.items()}, 6)
    g = {r: run.load_model(r)[0].canonical_state_dict()[EXPERT] for r in (2, 3, 4)}
    assert torch.equal(g[3][4:], g[2][4:])  # round 3: nobody trained node 2's experts; kept, not lost
    assert not torch.equal(g[4][4:], g[3][4:])  # from round 3 + evict_after_rounds on: trained by node 3
    assert run.record(3).nodes[2].status != "ok"
    sha = {r: run.store.read_manifest(run.layout.global_dir(r))["files"][MODEL_FILE]["sha256"] for r in (3, 4, 5)}

    assert train(resume_round=2)["rounds_run"] == [3, 4, 5]  # node 2 dead again; the stamped join again at 3
    assert {r: run.store.read_manifest(run.layout.global_dir(r))["files"][MODEL_FILE]["sha256"] for r in (3, 4, 5)} == sha
