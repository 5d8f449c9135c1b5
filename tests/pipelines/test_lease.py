import json
import time

import pytest

from pipelines.lease import RunLease
from spes.store import RunLocked, Store


def test_lease_outlives_its_ttl_while_held_and_is_released(tmp_path):
    store = Store(str(tmp_path))
    with RunLease(store, "r", ttl_s=0.6) as lease:
        time.sleep(1.5)  # longer than the ttl: only the background refresh keeps others out
        with pytest.raises(RunLocked, match="being written by"):
            Store(str(tmp_path)).acquire_lock("r", ttl_s=60)
        lease.check()
    assert not (tmp_path / "runs/r/LOCK.json").exists()
    Store(str(tmp_path)).acquire_lock("r", ttl_s=60)


def test_lost_lease_stops_the_writer(tmp_path):
    store = Store(str(tmp_path))
    with RunLease(store, "r", ttl_s=0.6) as lease:
        thief = {"owner": "other-host:1:abc", "expires_at": time.time() + 60}
        (tmp_path / "runs/r/LOCK.json").write_text(json.dumps(thief))  # taken over after a stall
        time.sleep(0.6)
        with pytest.raises(RunLocked, match="lease was lost.*other-host"):
            lease.check()
    assert json.loads((tmp_path / "runs/r/LOCK.json").read_text())["owner"] == "other-host:1:abc"  # not removed
