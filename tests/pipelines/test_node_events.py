"""The one node wire format: every event round-trips through its line, stray output stays a log line, a
damaged result is refused, and a stream without a result fails with the carrier named."""
import json
import logging

import pytest

from pipelines.node_events import EventFormatter, NodeEvent, decode, log_event, read_stream, report_of, result_event
from spes.errors import IntegrityError, NodeFailed, ProtocolError
from spes.round.progress_line import Progress

PROGRESS = Progress(1, 3, 10, 50, 3.8099, 10046, 1.0)


def test_every_event_round_trips_through_its_line():
    for event in (log_event("node 1 round 3: committed"), NodeEvent("progress", progress=PROGRESS),
                  result_event(error=IntegrityError("global 2 is damaged"))):
        assert decode(event.line()) == event
    assert json.loads(NodeEvent("progress", progress=PROGRESS).line()) == {"event": "progress", **PROGRESS.fields()}
    assert decode(NodeEvent("progress", progress=PROGRESS).line()).sentence() == PROGRESS.sentence()


def test_stray_output_is_a_log_event_and_a_progress_marker_a_progress_event():
    assert decode("W1206 torch.distributed warning\n") == log_event("W1206 torch.distributed warning")
    assert decode('{"event": "nonsense"}') == log_event('{"event": "nonsense"}')
    assert decode("[1, 2]") == log_event("[1, 2]")
    assert decode(f"12:00:00 INFO spes: {PROGRESS.line()}").progress == PROGRESS  # the library's own line
    damaged = json.dumps({"event": "progress", **{**PROGRESS.fields(), "steps": 0}})
    assert decode(damaged) == log_event(damaged)  # not taken on trust, not lost either


def test_a_result_carries_the_nodes_error_and_retry_advice_and_a_damaged_one_is_refused():
    failed = decode(result_event(error=NodeFailed("out of memory", retryable=False)).line())
    with pytest.raises(NodeFailed, match=r"node 2 round 4: NodeFailed: out of memory") as e:
        report_of(failed, 2, 4, "test")
    assert e.value.retryable is False
    for bad in ('{"event": "result"}', '{"event": "result", "ok": true}', '{"event": "result", "ok": "yes"}'):
        with pytest.raises(ProtocolError, match="damaged result event"):
            decode(bad)
    with pytest.raises(ProtocolError):
        result_event()


def test_a_stream_relays_its_events_until_the_result_and_fails_without_one():
    seen = []
    lines = [log_event("a").line(), "stray", NodeEvent("progress", progress=PROGRESS).line(),
             result_event(error=RuntimeError("boom")).line(), log_event("after").line()]
    with pytest.raises(NodeFailed, match="node 1 round 3: RuntimeError: boom"):
        read_stream(iter(lines), seen.append, 1, 3, "a test pipe")
    assert [e.kind for e in seen] == ["log", "log", "progress"]
    with pytest.raises(NodeFailed, match="node 1 round 3: a test pipe ended without a result"):
        read_stream(iter(lines[:2]), seen.append, 1, 3, "a test pipe")


def test_the_worker_formatter_writes_records_as_events():
    def line(msg, *args):
        return EventFormatter().format(logging.LogRecord("spes", logging.INFO, __file__, 1, msg, args, None))

    assert decode(line("node %d round %d: committed", 1, 3)) == log_event("node 1 round 3: committed")
    assert decode(line(PROGRESS.line())).progress == PROGRESS
    assert decode(line('{"event": "result", "ok": true, "meta": {}}')).kind == "log"  # text cannot forge a result



def test_a_relayed_failure_travels_on_in_the_nodes_own_words():
    """A host or a rank job that relays a node's failure does not wrap it again ("NodeFailed: node 0 ...")."""
    first = decode(result_event(error=ValueError("bad batch")).line())
    with pytest.raises(NodeFailed) as e:
        report_of(first, 0, 3, "worker")
    relayed = decode(result_event(error=e.value).line())
    assert relayed == first
    with pytest.raises(NodeFailed, match=r"^node 0 round 3: ValueError: bad batch$"):
        report_of(relayed, 0, 3, "host")
