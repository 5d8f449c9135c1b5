"""The round's progress artifact: a bar of the mean share of local steps done, and a row per node with its own
steps, last loss and tokens/s (issue 31, item 2). The Prefect calls are replaced by recorders here; the flow
tests read the real artifact back from a Prefect server."""
import pytest

import pipelines.round_progress as rp
from spes.round.progress_line import Progress


@pytest.fixture
def calls(monkeypatch):
    import prefect.artifacts

    made: list = []
    monkeypatch.setattr(prefect.artifacts, "create_progress_artifact", lambda **kw: made.append(("create", kw)) or "id")
    monkeypatch.setattr(prefect.artifacts, "update_progress_artifact",
                        lambda i, v, description=None: made.append(("update", v, description)))
    monkeypatch.setattr(rp, "MIN_GAP_S", 0.0)
    return made


def test_each_node_gets_its_row_and_the_bar_is_the_mean(calls):
    progress = rp.RoundProgress.start("k", "run", 3, 2)
    assert calls[0][1]["description"] == "Round 3: local steps done, mean over its 2 nodes"
    progress.node_done(0, 0.5, Progress(0, 3, 25, 50, 4.51234, 2500, 2.0))
    progress.node_done(1, 0.2)  # a heartbeat without an event: its share only
    _, value, text = calls[-1]
    assert value == pytest.approx(35.0)
    assert text.splitlines()[2:] == ["| node | local steps done | last loss | tokens/s |", "|---|---|---|---|",
                                     "| 0 | 25/50 | 4.5123 | 1,250 |", "| 1 | 20% | - | - |"]
    n = len(calls)
    progress.node_done(1, 0.2)  # nothing new: no write
    assert len(calls) == n
    assert rp.RoundProgress.of("run", 3) is progress and rp.RoundProgress.of("run", 4) is None
