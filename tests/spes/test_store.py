import json

import pytest
import torch

from spes.store import AlreadyCommitted, IntegrityError, NotCommitted, RunLocked, Store


def test_bundle_roundtrip_and_commit(tmp_path):
    s = Store(str(tmp_path))
    t = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    m = s.write_bundle("x", {"f.safetensors": t}, {"k": 1})
    assert m["files"]["f.safetensors"]["tensors"]["a"] == {"shape": [2, 3], "dtype": "float32"}
    b = s.read_bundle("x")
    assert torch.equal(b.files["f.safetensors"]["a"], t["a"]) and b.meta == {"k": 1}
    with pytest.raises(AlreadyCommitted):
        s.write_bundle("x", {"f.safetensors": t}, {})


def test_uncommitted_bundle_is_invisible_and_replaced(tmp_path):
    s = Store(str(tmp_path))
    s.write_bundle("runs/r/rounds/000001/global", {"model.safetensors": {"w": torch.zeros(1)}}, {})
    (tmp_path / "runs/r/rounds/000001/global/COMMIT").unlink()  # as if killed before the commit marker
    with pytest.raises(NotCommitted):
        s.read_bundle("runs/r/rounds/000001/global")
    assert s.committed_rounds("r") == []
    s.write_bundle("runs/r/rounds/000001/global", {"model.safetensors": {"w": torch.ones(1)}}, {})
    assert s.committed_rounds("r") == [1]


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest"])
def test_corruption_is_caught_and_names_the_file(tmp_path, damage):
    s = Store(str(tmp_path))
    s.write_bundle("x", {"f.safetensors": {"w": torch.randn(64)}}, {})
    f = tmp_path / "x" / "f.safetensors"
    blob = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(blob[:-10])
    elif damage == "flip":
        f.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    else:
        m = json.loads((tmp_path / "x" / "manifest.json").read_text())
        m["meta"] = {"evil": 1}
        (tmp_path / "x" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IntegrityError, match="manifest.json" if damage == "manifest" else "f.safetensors"):
        s.read_bundle("x")


def test_one_writer_per_run(tmp_path):
    s = Store(str(tmp_path))
    owner = s.acquire_lock("r", ttl_s=60)
    with pytest.raises(RunLocked, match="being written by"):
        Store(str(tmp_path)).acquire_lock("r", ttl_s=60)
    s.release_lock("r", owner)
    o2 = s.acquire_lock("r", ttl_s=-1)  # an expired lease (dead holder) can be taken over
    assert s.acquire_lock("r", ttl_s=60) != o2
