"""A node's local state: found by digest, foreign or damaged states refused, checkpoint as fallback."""
import dataclasses
import os

import pytest
import torch

from spes.errors import NodeStateError
from spes.run.node_state import NodeStateDir
from spes.run.records import StateRef
from spes.storage.store import Store


def _save(d, r, pos=7):
    return d.save_state(r, pos, {"w::exp_avg": torch.ones(2)}, {"w": torch.full((2,), 0.5)}, {"e": torch.zeros(1)})


def test_state_by_digest_from_here_or_the_checkpoint(tmp_path):
    shared = Store(str(tmp_path / "shared"))
    d = NodeStateDir(str(tmp_path / "local"), shared.url, "run", "id-1", 0)
    saved = _save(d, 3)
    ref = StateRef(3, saved["digest"], True)
    st = d.load_state(ref, shared, "ckpt")
    assert (st.round, st.data_position, st.residual["w"].tolist()) == (3, 7, [0.5, 0.5]) and d.has_state(ref)
    shared.write_bundle("ckpt", saved["files"], saved["meta"])  # what a checkpoint round writes
    d.local.remove("rounds/000003")
    assert not d.has_state(ref)
    assert d.load_state(ref, shared, "ckpt").source.endswith("ckpt")
    with pytest.raises(NodeStateError, match=r"state after round 3 .* not in .*000003 nor in the checkpoint"):
        d.load_state(dataclasses.replace(ref, digest="0" * 64), shared, "ckpt")
    with pytest.raises(NodeStateError, match="round 3 is no checkpoint round"):
        d.load_state(dataclasses.replace(ref, checkpoint=False), shared, "ckpt")


def test_foreign_or_damaged_state_is_refused(tmp_path):
    shared = Store(str(tmp_path / "shared"))
    mine = NodeStateDir(str(tmp_path / "local"), shared.url, "run", "id-1", 0)
    saved = _save(mine, 2)
    ref = StateRef(2, saved["digest"], False)
    other = NodeStateDir(str(tmp_path / "local"), shared.url, "run", "id-1", 1)
    other.local.write_bundle("rounds/000002", saved["files"], saved["meta"])  # node 0's state in node 1's folder
    with pytest.raises(NodeStateError, match="state of run id-1 node 0, not of run id-1 node 1"):
        other.load_state(ref, shared, "nothing")
    res = tmp_path / "local" / mine.path.split("local/")[1] / "rounds/000002/residual.safetensors"
    res.write_bytes(res.read_bytes()[:-4])  # a truncated residual
    with pytest.raises(NodeStateError, match="damaged: .*residual.safetensors: sha256/size mismatch"):
        mine.load_state(ref, shared, "nothing")


def test_discard_and_prune(tmp_path):
    d = NodeStateDir(str(tmp_path), "u", "run", "id", 0)
    for r in range(1, 6):
        _save(d, r)
    d.discard_after(3)
    d.prune_before(2)
    assert d.local.list_names("rounds") == ["000002", "000003"]
    assert d.base() is None
    sha = d.save_base(4, {"w": torch.arange(3.0)})
    assert d.base() == (4, sha) and d.load_base()["w"].tolist() == [0.0, 1.0, 2.0]


def test_other_runs_and_keeping_only_some_states(tmp_path):
    from spes.run.node_state import NodeStateDir

    old = NodeStateDir(str(tmp_path), "url", "r", "a" * 32, 0)
    other_node = NodeStateDir(str(tmp_path), "url", "r", "a" * 32, 1)
    other_run = NodeStateDir(str(tmp_path), "url", "r2", "b" * 32, 0)
    for d in (old, other_node, other_run):
        d.save_base(1, {"w": torch.zeros(2)})
        for r in (1, 2, 3):
            _save(d, r)
    new = NodeStateDir(str(tmp_path), "url", "r", "c" * 32, 0)
    new.save_base(1, {"w": torch.zeros(2)})
    assert new.sibling_runs() == [("r", "a" * 12), ("r2", "b" * 12)]  # node 1 is another machine's business
    assert other_run.keep_only({2}) and other_run.local.list_names("rounds") == ["000002"]
    assert other_run.base() is None and not other_run.keep_only({2})  # nothing left to drop
    assert old.keep_only(set()) and not os.path.exists(old.path)
    assert os.path.exists(other_node.path) and new.base() is not None
    assert new.sibling_runs() == [("r2", "b" * 12)]
