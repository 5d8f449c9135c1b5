import json

from spes.round.progress_line import MARKER, Progress, parse_progress, progress_of


def test_a_progress_event_round_trips_through_log_formatting():
    ev = Progress(1, 3, 10, 50, 3.8099, 10046, 1.0)
    assert parse_progress(f"12:00:00 INFO spes.round.node: {ev.line()}") == ev
    assert ev.sentence() == "node 1 round 3: step 10/50, loss 3.8099, 10046 tokens/s, 4 s left in the round"
    assert ev.fraction == 0.2


def test_the_relays_read_fields_not_wording():
    # a sentence that looks like progress is not an event; only the marked JSON is
    assert parse_progress("node 1 round 3: step 10/50, loss 3.8, 100 tokens/s") is None
    assert parse_progress("node 1 round 3: committed") is None
    d = json.loads(Progress(0, 1, 5, 10, 4.0, 10, 1.0).line()[len(MARKER):])
    d["extra"] = 1
    assert parse_progress(MARKER + json.dumps(d)) is None  # a field it does not know: not taken on trust
    assert parse_progress(MARKER + "{not json") is None
    assert parse_progress(MARKER + json.dumps({"event": "result"})) is None


def test_an_event_travels_as_fields_and_damaged_fields_are_no_event():
    ev = Progress(1, 3, 10, 50, 3.8099, 10046, 1.0)
    assert progress_of(json.loads(json.dumps(ev.fields()))) == ev  # as a heartbeat carries it
    for bad in (None, "x", {}, {**ev.fields(), "steps": 0}, {**ev.fields(), "loss": "low"},
                {**ev.fields(), "done": True}, {**ev.fields(), "extra": 1}):
        assert progress_of(bad) is None, bad
