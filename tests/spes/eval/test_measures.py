"""The report's measures beside the final loss: tokens to reach a stated loss (hand-computed interpolation),
epochs over the training split, and what the held-out set is."""
import os

import pytest

from spes.config.loader import load_params
from spes.eval.compare import summarize
from spes.eval.measures import heldout_set, tokens_to_reach
from spes.eval.report import report_markdown
from tests.conftest import ROOT
from tests.spes.eval.test_compare import _result


def _curve(*losses, step=100):
    return [{"round": i + 1, "tokens": step * (i + 1), "heldout_loss": x} for i, x in enumerate(losses)]


def test_tokens_to_reach_interpolates_between_the_rounds_around_the_crossing():
    c = _curve(5.0, 4.0, 3.0)
    assert tokens_to_reach(c, 3.5) == 250.0  # half way from 4.0 (200 tokens) to 3.0 (300 tokens)
    assert tokens_to_reach(c, 3.0) == 300.0 and tokens_to_reach(c, 4.75) == 125.0
    assert tokens_to_reach(c, 6.0) == 100.0  # already there after the first round
    assert tokens_to_reach(c, 2.9) is None
    assert tokens_to_reach(_curve(5.0, 4.0, 4.5, 3.0), 4.2) == 180.0  # the first crossing counts


def test_reach_table_epochs_and_held_out_set_in_the_report():
    p = load_params(os.path.join(ROOT, "params.yaml"))
    p.compare.variants = {"spes": [], "centralized": ["sync.method=centralized"]}
    p.compare.pairs = {}
    results = [_result("spes", 0, 0.002, 3.4, curve=_curve(5.0, 4.0, 3.4), train_tokens=500, tokens=300,
                       heldout_documents=[0, 0, 0, 1]),
               _result("spes", 1, 0.002, 3.5, curve=_curve(5.0, 4.2, 3.5), train_tokens=500, tokens=300),
               _result("centralized", 0, 0.002, 3.0, curve=_curve(4.5, 3.5, 3.0), train_tokens=500, tokens=300),
               _result("centralized", 1, 0.002, 3.2, curve=_curve(4.4, 3.6, 3.2), train_tokens=500, tokens=300)]
    s = summarize(p, results)
    reach = {x["variant"]: x for x in s["reach"]}
    # the target is the highest last per-round loss, 3.5: spes seed 0 crosses it between 4.0 and 3.4
    assert reach["spes"]["target"] == 3.5 and reach["spes"]["per_seed"][1] == 300.0
    assert reach["spes"]["per_seed"][0] == pytest.approx(200 + 100 * 0.5 / 0.6)
    assert reach["centralized"]["per_seed"] == [200.0, pytest.approx(200 + 100 * 0.1 / 0.4)]
    assert reach["spes"]["to_baseline"] == pytest.approx(
        (200 + 100 * 0.5 / 0.6 + 300) / (200 + 200 + 100 * 0.1 / 0.4))
    assert {r["variant"]: r["epochs"] for r in s["rows"]} == {"spes": 0.6, "centralized": 0.6}
    assert s["heldout"] == {"documents": 2, "windows": 4, "largest_share": 0.75, "cap": None}
    md = report_markdown(p, s)
    assert "Held-out set: 4 windows of 2 documents, every window of every document (no cap per document); " \
           "the largest document holds 75.0% of the windows." in md
    assert "| 300 | 0.60 |" in md and "| centralized | 1x | 3.5000 | 200, 225 | 212 | 1.00 |" in md
    p.compare.target_loss = 3.3
    spes, central = summarize(p, results)["reach"]
    assert spes["per_seed"] == [None, None] and spes["mean"] is None and spes["to_baseline"] is None  # never there
    assert central["per_seed"] == [pytest.approx(200 + 100 * 0.2 / 0.5), pytest.approx(200 + 100 * 0.3 / 0.4)]


def test_held_out_set_names_its_cap():
    p = load_params(os.path.join(ROOT, "params.yaml"))
    p.eval.max_windows_per_document = 8
    assert heldout_set(p, [_result("spes", 0, 0.002, 3.0, heldout_documents=[0, 1, 1, 2])])["cap"] == 8
    assert heldout_set(p, [_result("spes", 0, 0.002, 3.0)]) is None


def test_the_report_names_the_machine_kinds_its_cells_ran_on():
    p = load_params(os.path.join(ROOT, "params.yaml"))
    p.compare.variants = {"spes": [], "centralized": ["sync.method=centralized"]}
    p.compare.pairs = {}
    amd = "AMD EPYC, AVX2, torch 2.13.0+cpu"
    one = [_result("spes", 0, 0.002, 3.0, machine=amd), _result("centralized", 0, 0.002, 2.9, machine=amd)]
    s = summarize(p, one)
    assert s["machines"] == {amd: 2}
    assert f"Machine: {amd}: 2 cells (" in report_markdown(p, s)
    mixed = one + [_result("spes", 1, 0.002, 3.1), _result("centralized", 1, 0.002, 3.0, machine="Intel Xeon, AVX2")]
    s = summarize(p, mixed)
    assert s["machines"] == {amd: 2, "Intel Xeon, AVX2": 1, "not recorded": 1}
    assert "**Machines: the cells ran on 3 kinds** (" in report_markdown(p, s)


def test_a_cell_records_the_machine_kind_it_ran_on():
    import torch

    from stages.compare import machine_kind

    kind = machine_kind()
    assert kind.endswith(f", {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
    assert len(kind.split(", ")) >= 3 and kind.split(", ")[0]
