"""A node's progress line reads back as what it says (the round's progress artifact depends on it)."""
from spes.round.progress_line import parse_progress, progress_line


def test_a_progress_line_round_trips():
    line = progress_line(1, 3, 10, 50, 3.8099, 10046, 1.0)
    assert line == "node 1 round 3: step 10/50, loss 3.8099, 10046 tokens/s, 4 s left in the round"
    assert parse_progress(f"12:00:00 INFO node 0 | {line}") == (1, 3, 10, 50)
    assert parse_progress("node 1 round 3: committed") is None
