"""The bundle format: commit marker, verification of every byte, safe paths, bounded retried calls."""
import json
import logging
import os

import pytest
import torch

from spes.errors import AlreadyCommitted, IntegrityError, NotCommitted, StoreUnavailable, UnsafePath
from spes.storage.store import Store


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
    s.write_bundle("y", {"model.safetensors": {"w": torch.zeros(1)}}, {})
    (tmp_path / "y/COMMIT").unlink()  # as if killed before the commit marker
    with pytest.raises(NotCommitted):
        s.read_bundle("y")
    assert not s.is_committed("y")
    s.write_bundle("y", {"model.safetensors": {"w": torch.ones(1)}}, {})
    assert s.read_bundle("y").files["model.safetensors"]["w"].item() == 1.0


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "missing"])
def test_corruption_is_caught_and_names_the_file(tmp_path, damage):
    s = Store(str(tmp_path))
    s.write_bundle("x", {"f.safetensors": {"w": torch.randn(64)}}, {})
    f = tmp_path / "x" / "f.safetensors"
    blob = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(blob[:-10])
    elif damage == "flip":
        f.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    elif damage == "missing":
        f.unlink()
    else:
        m = json.loads((tmp_path / "x" / "manifest.json").read_text())
        m["meta"] = {"evil": 1}
        (tmp_path / "x" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IntegrityError, match="manifest.json" if damage == "manifest" else "x/f.safetensors"):
        s.read_bundle("x")


@pytest.mark.parametrize("rel", ["../x", "a/../../b", "/etc/passwd", "a//b", "./a", "a/..", "a\\b"])
def test_paths_never_leave_the_root(tmp_path, rel):
    s = Store(str(tmp_path / "root"))
    with pytest.raises(UnsafePath):
        s.write_bytes(rel, b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def test_exclusive_create_and_listing(tmp_path):
    s = Store(str(tmp_path))
    s.create_exclusive("d/a.json", b"1")
    with pytest.raises(FileExistsError):
        s.create_exclusive("d/a.json", b"2")
    s.write_bytes("d/b.json", b"3")
    assert s.list_names("d") == ["a.json", "b.json"] and s.list_names("nothing") == []
    assert s.read_bytes("d/a.json") == b"1" and s.size_of("d") == 2


def test_transient_errors_are_retried_and_logged_then_fail_clearly(tmp_path, caplog, monkeypatch):
    s = Store(str(tmp_path), retries=2, backoff_s=0.01)
    s.write_bytes("f", b"payload")
    real, calls = s.fs.cat_file, []

    def flaky(path, *a, **kw):
        calls.append(path)
        if len(calls) <= 2:
            raise ConnectionResetError("connection reset by peer")
        return real(path, *a, **kw)

    monkeypatch.setattr(s.fs, "cat_file", flaky)
    with caplog.at_level(logging.WARNING, logger="spes.storage.store"):
        assert s.read_bytes("f") == b"payload"
    assert len(calls) == 3 and [r.message for r in caplog.records if "retry" in r.message][1].count("retry 2/2")
    monkeypatch.setattr(s.fs, "cat_file", lambda *a, **k: (_ for _ in ()).throw(TimeoutError("read timed out")))
    with pytest.raises(StoreUnavailable, match=r"read f failed after 3 tries: TimeoutError: read timed out"):
        s.read_bytes("f")
    monkeypatch.setattr(s.fs, "cat_file", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("f")))
    with pytest.raises(FileNotFoundError):  # a definite answer is not retried
        s.read_bytes("f")


def test_exclusive_create_without_hard_links(tmp_path, monkeypatch):
    """Filesystems without hard links fall back to O_EXCL: still exclusive, same content."""
    import errno

    def no_links(src, dst):
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    s = Store(str(tmp_path / "s"))
    s.create_exclusive("d/a.json", b"1")
    with pytest.raises(FileExistsError):
        s.create_exclusive("d/a.json", b"2")
    assert s.read_bytes("d/a.json") == b"1" and s.list_names("d") == ["a.json"]


def test_a_manifest_read_before_is_taken_only_while_its_commit_marker_names_it(tmp_path):
    store = Store(str(tmp_path))
    store.write_bundle("b", {"x.safetensors": {"t": torch.ones(2)}}, {"round": 1})
    held = store.read_marked("b")
    before = store.bytes_read
    assert store.read_manifest("b", held) is held[1]
    assert store.bytes_read - before == len(held[0])  # only the COMMIT marker was read
    store.remove("b")
    store.write_bundle("b", {"x.safetensors": {"t": torch.zeros(2)}}, {"round": 1})  # the same round, written anew
    again = store.read_manifest("b", held)
    assert again is not held[1] and again["files"] != held[1]["files"]
    twin = store.counted_apart()  # the same storage with counters of its own
    twin.read_manifest("b")
    assert twin.bytes_read > 0 and store.bytes_read - before > 0 and twin.root == store.root
