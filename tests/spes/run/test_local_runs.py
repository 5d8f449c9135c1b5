"""A node machine's folders of runs: keyed by the storage's exact location, so copies of the repository (DVC
experiments, clones) never tidy each other's runs; damaged local copies heal from their committed twins."""
import logging
import os

import pytest
import torch

from spes.data.tokens import TokenData
from spes.round.aggregator import aggregate_round
from spes.round.context import RoundContext
from spes.round.node import NodeRound
from spes.run.layout import MODEL_FILE
from spes.run.local_runs import node_state_root, open_node_state
from spes.run.node_state import NodeStateDir
from spes.storage.store import Store
from tests.spes.round.test_round import make_params, start


@pytest.fixture(scope="module")
def data(tiny_tokens):
    return TokenData.open(tiny_tokens)


def _rounds(p, run, data, rounds):
    for r in rounds:
        for i in (0, 1):
            NodeRound(RoundContext.build(p, "r", run.store), r, i, data).run()
        aggregate_round(RoundContext.build(p, "r", run.store), r)


def _global_sha(run, r):
    return run.store.read_manifest(run.layout.global_dir(r))["files"][MODEL_FILE]["sha256"]


def _clone(tmp_path, monkeypatch, name, nodes):
    """A copy of the repository: its own folder, `storage.url: artifacts/storage` as written, the machine's
    one node-state folder (as ~/.cache/spes/state) shared with every other copy."""
    (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path / name)
    p = make_params(tmp_path)
    p.storage.url, p.orchestration.node_state_dir = "artifacts/storage", str(nodes)
    return p


def test_copies_of_the_repository_never_tidy_each_others_runs(tmp_path, monkeypatch, data):
    """Clone A trains two rounds (node state kept on the machine, round 2 no checkpoint); clone B then trains
    its own run of the same name, which tidies this machine's folders of runs its storage calls gone or started
    anew. A then resumes at round 3 from its local state of round 2, and ends bitwise as a clone that nobody
    disturbed (before, B's first round deleted A's folder: the same relative URL gave the same key)."""
    nodes = tmp_path / "machine-state"
    p_ref = _clone(tmp_path, monkeypatch, "reference", nodes)
    ref = start(p_ref)
    _rounds(p_ref, ref, data, (1, 2, 3))
    p_a = _clone(tmp_path, monkeypatch, "a", nodes)
    a = start(p_a)
    _rounds(p_a, a, data, (1, 2))
    p_b = _clone(tmp_path, monkeypatch, "b", nodes)
    b = start(p_b)
    _rounds(p_b, b, data, (1,))
    monkeypatch.chdir(tmp_path / "a")
    a_id = a.info()["run_id"]
    for i in (0, 1):
        assert open_node_state(p_a, a.store, "r", a_id, i).local.list_names("rounds")[-1:] == ["000002"]
    _rounds(p_a, a, data, (3,))
    assert _global_sha(a, 3) == _global_sha(ref, 3)
    assert len(os.listdir(nodes)) == 3, os.listdir(nodes)  # one folder per storage location


def test_a_state_kept_under_the_former_key_is_taken_over_once(tmp_path, monkeypatch, caplog):
    """States written before the key named the exact location (it hashed the URL as written) are moved into
    place for the same run id, a uuid: an upgrade loses no resumable round."""
    monkeypatch.chdir(tmp_path)
    p = make_params(tmp_path)
    p.storage.url = "artifacts/storage"
    store = Store.from_config(p.storage)
    old = NodeStateDir(node_state_root(p), store.url, "r", "a" * 32, 0)
    old.save_base(1, {"w": torch.zeros(2)})
    with caplog.at_level(logging.INFO, "spes.run.local_runs"):
        new = open_node_state(p, store, "r", "a" * 32, 0)
    assert new.path != old.path and new.base() is not None and not os.path.exists(os.path.dirname(old.path))
    assert "moved its local state of run r" in caplog.text
    other = NodeStateDir(node_state_root(p), store.url, "r", "b" * 32, 0)  # another run id: not taken
    other.save_base(1, {"w": torch.zeros(2)})
    assert open_node_state(p, store, "r", "c" * 32, 0).base() is None and other.base() is not None


def test_a_flipped_byte_in_a_nodes_copy_of_the_global_heals(tmp_path, data, caplog):
    """One flipped byte in node 0's local copy of global 1: round 2 logs one line naming the file, reads the
    global from storage and ends bitwise as the undamaged run; the copy held afterwards is sound."""
    p_ref = make_params(tmp_path, "ref")
    ref = start(p_ref)
    _rounds(p_ref, ref, data, (1, 2))
    p = make_params(tmp_path, "bad")
    run = start(p)
    _rounds(p, run, data, (1,))
    local = open_node_state(p, run.store, "r", run.info()["run_id"], 0)
    f = os.path.join(local.path, "base", MODEL_FILE)
    blob = bytearray(open(f, "rb").read())
    blob[-3] ^= 0x10
    open(f, "wb").write(bytes(blob))
    with caplog.at_level(logging.WARNING):
        _rounds(p, run, data, (2,))
    damaged = [r.getMessage() for r in caplog.records if "local copy of the global is damaged" in r.getMessage()]
    assert len(damaged) == 1 and f"base/{MODEL_FILE}" in damaged[0], caplog.text
    assert _global_sha(run, 2) == _global_sha(ref, 2)
    assert local.base() == (1, _global_sha(run, 1))  # kept again, sound: what round 2 started from
    assert local.load_base() is not None
