"""Heartbeats on storage: a writer that beats while in use, a watch that measures silence by its own clock."""
import json
import time

from spes.run.heartbeat import Heartbeat, HeartbeatWatch
from spes.storage.store import Store


def test_a_beating_node_is_never_silent_long_and_a_stopped_one_is(tmp_path):
    store = Store(str(tmp_path / "s"))
    watch = HeartbeatWatch(store, "r", 3, 1)
    with Heartbeat(store, "r", 3, 1, interval_s=0.05):
        for _ in range(6):
            time.sleep(0.05)
            watch.poll()
            assert watch.silent_s() < 0.5
        beat = json.loads(store.read_bytes("runs/r/heartbeats/001.json"))
        assert beat["round"] == 3 and beat["node"] == 1 and beat["beat"] >= 2
    time.sleep(0.3)
    watch.poll()
    assert watch.silent_s() >= 0.3  # the content stopped changing when the heartbeat stopped


def test_a_beat_of_another_round_or_none_at_all_counts_as_silence(tmp_path):
    store = Store(str(tmp_path / "s"))
    watch = HeartbeatWatch(store, "r", 4, 0)
    watch.poll()  # no file yet
    Heartbeat(store, "r", 3, 0, interval_s=1).write()  # the previous round's
    time.sleep(0.2)
    watch.poll()
    assert watch.silent_s() >= 0.2
    store.write_bytes("runs/r/heartbeats/000.json", b"not json")
    watch.poll()
    assert watch.silent_s() >= 0.2
    Heartbeat(store, "r", 4, 0, interval_s=1).write()
    watch.poll()
    assert watch.silent_s() < 0.2
