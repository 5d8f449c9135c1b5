"""A round as library calls against a local Store, no Prefect: node rounds, aggregation, quorum, retries."""
import pytest
import torch

from spes.config import Params
from spes.data import TokenData
from spes.rounds import aggregate_round, latest_node_state, load_global, node_round
from spes.runs import MODEL_FILE, UPLOAD_FILE, InitModel, Run, settings_fingerprint
from spes.store import Store, StoreError
from tests.conftest import tiny_config


def _params(tmp_path) -> Params:
    p = Params(model=tiny_config(vocab_size=512))
    p.spes.num_nodes, p.spes.sync_steps, p.spes.rounds, p.spes.batch_size, p.spes.seq_len = 2, 2, 3, 2, 16
    p.spes.merge.enabled = False
    p.storage.url, p.orchestration.device = str(tmp_path / "storage"), "cpu"
    return p


@pytest.fixture
def setup(tmp_path, tiny_tokens):
    p = _params(tmp_path)
    store = Store.from_config(p.storage)
    torch.manual_seed(0)
    Run(store, "r").ensure(settings_fingerprint(p), InitModel.from_state(p.model.build().canonical_state_dict(),
                                                                        p.model, "scratch"))
    return p, store, TokenData.open(tiny_tokens)


def test_one_round_exact_aggregation(setup):
    p, store, data = setup
    metas = [node_round(p, store, "r", 1, i, data) for i in (0, 1)]
    assert [m["experts"] for m in metas] == [[0, 1], [2, 3]] and all(m["bytes_up"] > 0 for m in metas)
    agg = aggregate_round(p, store, "r", 1)
    assert agg["contributors"] == [0, 1] and agg["missing"] == []
    ups = [store.read_bundle(f"runs/r/rounds/000001/nodes/{i:03d}").files[UPLOAD_FILE] for i in (0, 1)]
    new = load_global(store, "r", 1)[0].canonical_state_dict()
    for name, t in new.items():
        if ".experts." in name:
            assert torch.equal(t[:2], ups[0][name]) and torch.equal(t[2:], ups[1][name]), name
        else:
            assert torch.equal(t, ((ups[0][name].double() + ups[1][name].double()) / 2).float()), name


def test_a_retried_node_round_is_idempotent(setup):
    p, store, data = setup
    first = node_round(p, store, "r", 1, 0, data)
    before = store.read_manifest("runs/r/rounds/000001/nodes/000")
    again = node_round(p, store, "r", 1, 0, data)
    assert store.read_manifest("runs/r/rounds/000001/nodes/000") == before  # not recomputed, not rewritten
    assert {k: again[k] for k in first if k != "seconds_save"} == {k: first[k] for k in first if k != "seconds_save"}


def test_quorum_and_a_node_that_misses_a_round(setup):
    p, store, data = setup
    for i in (0, 1):
        node_round(p, store, "r", 1, i, data)
    aggregate_round(p, store, "r", 1)
    node_round(p, store, "r", 2, 0, data)
    with pytest.raises(StoreError, match=r"round 2: only nodes \[0\] committed, quorum is 2 of 2"):
        aggregate_round(p, store, "r", 2)
    agg = aggregate_round(p, store, "r", 2, min_nodes=1)
    assert (agg["contributors"], agg["missing"]) == ([0], [1])
    g1, g2 = (load_global(store, "r", r)[0].canonical_state_dict() for r in (1, 2))
    assert torch.equal(g2["model.layers.0.mlp.experts.down_proj"][2:], g1["model.layers.0.mlp.experts.down_proj"][2:])
    # node 1 continues in round 3 from its own last state (round 1), not from nothing
    state = latest_node_state(store, "r", 1, 3)
    assert state.meta["round"] == 1
    assert node_round(p, store, "r", 3, 1, data)["loss_first"] > 0
