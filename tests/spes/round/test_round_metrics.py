"""A home for per-round metrics (issue 47, item 4): a metric named in one place (HeldOutProbe.METRICS) is in
the round's record on storage, on TensorBoard (`eval/<name>`) and in the round's table line in the UI; a
record written before metrics existed reads as having none."""
import json

import pytest

from pipelines.round import table_description
from spes.data.tokens import TokenData
from spes.round.driver import HeldOutProbe
from spes.run.board import RunBoard, board_dir
from spes.run.records import RoundRecord
from tests.spes.round.test_driver import _params, _start, round_one
from tests.spes.run.test_board import _read


@pytest.fixture(scope="module")
def data(tiny_tokens):
    return TokenData.open(tiny_tokens)


def test_a_metric_named_in_one_place_reaches_the_record_the_board_and_the_table(tmp_path, data, monkeypatch):
    monkeypatch.setattr(HeldOutProbe, "METRICS", dict(HeldOutProbe.METRICS, heldout_perplexity="perplexity"))
    p = _params(tmp_path, rounds=1)
    p.artifacts_dir = str(tmp_path / "artifacts")  # the board's events under it
    run = _start(p)
    rec = round_one(p, run, data, HeldOutProbe(p, data.folder))
    m = run.record(1).metrics
    assert sorted(m) == ["heldout_accuracy", "heldout_perplexity", "heldout_se"] and m == rec.metrics
    assert 0.0 <= m["heldout_accuracy"] <= 1.0
    assert m["heldout_perplexity"] == pytest.approx(2.718281828459045 ** rec.heldout_loss, rel=1e-12)
    b = RunBoard(p, run.name, [])
    b.add(rec)
    b.close()
    board = _read(f"{board_dir(p, run.name)}/global")
    for name, value in m.items():
        assert board[f"eval/{name}"] == [(p.sync.every_steps, pytest.approx(value, rel=1e-6))]
    line = table_description(rec)
    assert all(f"{name} {value:.4g}" in line for name, value in m.items()), line


def test_a_record_written_before_metrics_reads_as_having_none(tmp_path, data):
    p = _params(tmp_path, rounds=1)
    run = _start(p)
    rec = round_one(p, run, data)
    old = rec.to_json()
    del old["metrics"]
    back = RoundRecord.from_json(json.loads(json.dumps(old)), "an old record")
    assert back.metrics == {} and back.heldout_loss == rec.heldout_loss
    assert "heldout_" not in table_description(back).split("held-out loss")[1].split(", wall")[0]
