"""The writer lease: one holder, atomic takeover, same-host crash recovery, background refresh."""
import json
import os
import subprocess
import sys
import time

import pytest

from spes.errors import RunLocked
from spes.run.lease import RunLease, WriterLease
from spes.storage.store import Store


def _gen_files(tmp_path):
    return sorted(os.listdir(tmp_path / "runs/r/lease"))


def test_one_holder_then_release_then_next_generation(tmp_path):
    a = WriterLease(Store(str(tmp_path)), "r", 60).acquire()
    with pytest.raises(RunLocked, match=f"being written by {a.owner}"):
        WriterLease(Store(str(tmp_path)), "r", 60).acquire()
    a.release()
    b = WriterLease(Store(str(tmp_path)), "r", 60).acquire()
    assert (a.gen, b.gen) == (0, 1)
    with pytest.raises(RunLocked, match="lost the lease"):
        a.check()
    a.release()  # not ours any more: must not free b's lease
    with pytest.raises(RunLocked, match="being written by"):
        WriterLease(Store(str(tmp_path)), "r", 60).acquire()


def test_expired_lease_is_taken_over(tmp_path):
    a = WriterLease(Store(str(tmp_path)), "r", 0.2).acquire()
    time.sleep(0.3)
    b = WriterLease(Store(str(tmp_path)), "r", 60).acquire()
    assert b.gen == a.gen + 1
    with pytest.raises(RunLocked, match="lost the lease"):
        a.refresh()


def test_lease_of_a_dead_process_on_this_host_is_free_at_once(tmp_path):
    code = ("import sys; sys.path.insert(0, %r); from spes.run.lease import WriterLease; from spes.storage.store import Store; "
            "WriterLease(Store(%r), 'r', 3600).acquire()") % (os.getcwd(), str(tmp_path))
    subprocess.run([sys.executable, "-c", code], check=True)  # acquires, then exits without releasing
    held = json.loads((tmp_path / "runs/r/lease/0000000000.json").read_text())
    assert held["expires_at"] > time.time() + 3000 and not held["released"]
    assert WriterLease(Store(str(tmp_path)), "r", 60).acquire().gen == 1


def test_a_foreign_host_is_never_presumed_dead(tmp_path):
    lease = {"owner": "elsewhere:1:x", "host": "elsewhere", "boot_id": "b", "pid": 1, "expires_at": time.time() + 60,
             "released": False}
    (tmp_path / "runs/r/lease").mkdir(parents=True)
    (tmp_path / "runs/r/lease/0000000004.json").write_text(json.dumps(lease))
    with pytest.raises(RunLocked, match="elsewhere:1:x"):
        WriterLease(Store(str(tmp_path)), "r", 60).acquire()


def test_ttl_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="ttl"):
        WriterLease(Store(str(tmp_path)), "r", 0)


def test_run_lease_outlives_its_ttl_while_held_and_is_released(tmp_path):
    store = Store(str(tmp_path))
    with RunLease(store, "r", ttl_s=0.6) as lease:
        time.sleep(1.5)  # longer than the ttl: only the background refresh keeps others out
        with pytest.raises(RunLocked, match="being written by"):
            WriterLease(Store(str(tmp_path)), "r", 60).acquire()
        lease.check()
    assert WriterLease(Store(str(tmp_path)), "r", 60).acquire().gen == 1


def test_lost_lease_stops_the_writer(tmp_path):
    store = Store(str(tmp_path))
    with RunLease(store, "r", ttl_s=0.6) as lease:
        thief = {"owner": "other-host:1:abc", "host": "other-host", "expires_at": time.time() + 60, "released": False}
        (tmp_path / "runs/r/lease/0000000001.json").write_text(json.dumps(thief))  # taken over after a stall
        with pytest.raises(RunLocked, match="lease was lost.*other-host"):
            lease.check()
    assert json.loads((tmp_path / "runs/r/lease/0000000001.json").read_text())["owner"] == "other-host:1:abc"
    assert _gen_files(tmp_path) == ["0000000000.json", "0000000001.json"]


def test_a_failure_after_the_lease_was_lost_says_it_lost_the_lease(tmp_path):
    from spes.errors import NotCommitted

    store = Store(str(tmp_path))
    with RunLease(store, "r", ttl_s=60) as lease:
        lease.explain(NotCommitted("x is not committed"))  # the lease is held: the error stands as it is
        thief = {"owner": "other-host:1:abc", "host": "other-host", "expires_at": time.time() + 60, "released": False}
        (tmp_path / "runs/r/lease/0000000001.json").write_text(json.dumps(thief))
        with pytest.raises(RunLocked, match=r"lease was lost.*other-host.*what stopped it then: NotCommitted: x is not"):
            lease.explain(NotCommitted("x is not committed"))
