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
    watch.poll()  # the last beat, written before the heartbeat stopped (under load, after the loop's last poll)
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


def test_the_nodes_last_progress_event_rides_on_its_heartbeat(tmp_path):
    store = Store(str(tmp_path / "s"))
    beat = Heartbeat(store, "r", 2, 1, interval_s=1)
    beat.progress, beat.event = 0.2, {"node": 1, "round": 2, "done": 10, "steps": 50, "loss": 3.5, "tokens": 100,
                                      "seconds": 1.0}
    beat.write()
    watch = HeartbeatWatch(store, "r", 2, 1)
    watch.poll()
    assert watch.progress == 0.2 and watch.event == beat.event
