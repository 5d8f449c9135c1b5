"""The comparison matrix: variants differ in what they name and nothing else, at equal tokens; bad matrices
are refused in one line; the report's arithmetic is exact."""
import os

import pytest

from spes.config.loader import load_params, to_dict
from spes.errors import ConfigError, DataError
from spes.eval.compare import cells, check_matrix, run_tokens, summarize, variant_params
from spes.eval.report import report_markdown
from spes.sync.methods import sync_method
from tests.conftest import ROOT

PARAMS_YAML = os.path.join(ROOT, "params.yaml")


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "variants":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _diff(a, b):
    fa, fb = _flat(to_dict(a)), _flat(to_dict(b))
    return {k for k in fa if fa[k] != fb[k]}


def test_variants_differ_only_in_what_they_name_and_train_on_equal_tokens():
    p = load_params(PARAMS_YAML)
    v = check_matrix(p)
    assert _diff(v["spes"], v["centralized"]) == {"sync.method"}
    m = sync_method(v["spes"])
    assert (m.nodes, m.node_batch_size) == (2, 8)
    m = sync_method(v["centralized"])
    assert (m.nodes, m.node_batch_size) == (1, 16)  # derived, not set
    assert _diff(v["spes"], v["spes-4nodes"]) == {"sync.num_nodes", "train.batch_size"}
    assert _diff(v["spes"], v["spes-int8"]) == {"sync.codec"}
    assert _diff(v["spes"], v["spes-no-merge"]) == {"merge.enabled"}
    assert _diff(v["fedavg"], v["fedadam"]) == {"sync.method", "outer.lr"}
    assert len({run_tokens(x) for x in v.values()}) == 1
    cell = variant_params(p, "diloco", seed=1, lr=0.004, budget=4)
    assert _diff(v["diloco"], cell) == {"train.seed", "train.optim.lr", "sync.rounds"} and cell.sync.rounds == 40
    assert len(cells(p)) == 8 * 2 and cells(p)[0].run_name == "cmp-spes-0-0.002-1"


@pytest.mark.parametrize("variants,message", [
    ({"spes": ["spes.nodes=3"]}, "compare.variants.spes: .*nodes"),
    ({"spes": ["tokenize.max_files=3"]}, "tokenize.max_files may not differ between variants"),
    ({"spes": ["model.hidden_size=64"]}, "model.hidden_size may not differ"),
    ({"spes": ["train.batch_size=4"]}, "compare.variants.spes trains on .* tokens, the others on"),
    ({"spes": ["sync.num_nodes=3"]}, "compare.variants.spes: .*cannot be split evenly over 3 nodes"),
    ({"bad/name": []}, "not a safe name"),
    ({"spes": ["merge.enabled"]}, "is not key=value"),
])
def test_bad_matrices_are_refused_in_one_line(variants, message):
    p = load_params(PARAMS_YAML)
    p.compare.variants = {**variants, "centralized": ["sync.method=centralized"]}
    p.compare.pairs = {}
    with pytest.raises(ConfigError, match=message) as e:
        check_matrix(p)
    assert "\n" not in str(e.value)


def test_duplicate_variant_names_and_a_missing_baseline(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("compare:\n  variants:\n    spes: []\n    spes: [sync.method=fedavg]\n")
    with pytest.raises(ConfigError, match="duplicate key spes"):
        load_params(str(f))
    p = load_params(PARAMS_YAML)
    p.compare.baseline = "nope"
    with pytest.raises(ConfigError, match="compare.baseline 'nope' is not one of"):
        check_matrix(p)


def _result(variant, seed, lr, loss, **kw):
    base = {"variant": variant, "seed": seed, "lr": lr, "budget": 1, "heldout_loss": loss, "heldout_se": 0.01,
            "tokens": 1000, "trainable_params_per_node": 10, "memory_bytes_per_node": 2**20,
            "bytes_per_node_per_round": 3 * 2**20, "wall_s": 5.0, "curve": []}
    return {**base, **kw}


def test_summary_exact_numbers():
    p = load_params(PARAMS_YAML)
    p.compare.variants = {"spes": [], "spes-no-merge": ["merge.enabled=false"], "centralized": ["sync.method=centralized"]}
    p.compare.lrs = [0.001, 0.002]
    results = [_result("spes", 0, 0.001, 3.0), _result("spes", 1, 0.001, 3.2), _result("spes", 0, 0.002, 3.5),
               _result("spes", 1, 0.002, 3.7), _result("spes-no-merge", 0, 0.001, 3.05),
               _result("spes-no-merge", 1, 0.001, 3.35), _result("spes-no-merge", 0, 0.002, 3.9),
               _result("spes-no-merge", 1, 0.002, 3.9), _result("centralized", 0, 0.002, 2.5, wall_s=7.0),
               _result("centralized", 1, 0.002, 2.7, wall_s=9.0), _result("centralized", 0, 0.001, 2.9),
               _result("centralized", 1, 0.001, 2.9)]
    s = summarize(p, results)
    rows = {r["variant"]: r for r in s["rows"]}
    assert rows["spes"]["lr"] == 0.001 and rows["spes"]["heldout_loss_mean"] == pytest.approx(3.1)
    assert rows["spes"]["heldout_loss_std"] == pytest.approx(0.1414213562, rel=1e-6)
    assert rows["centralized"]["lr"] == 0.002 and rows["centralized"]["wall_s"] == 8.0
    assert rows["spes"]["ratio_to_centralized"] == pytest.approx(3.1 / 2.6)
    assert rows["centralized"]["ratio_to_centralized"] == 1.0
    md = report_markdown(p, s)
    assert "| spes | - | 2 | 0.001 | 3.1000 +- 0.1414 | 0.0100 | 1.1923 |" in md
    assert "| spes | 1x | 0.002 | 3.6000 | 0.1414 |" in md


def test_metrics_are_picked_up_by_name_where_every_seed_has_them():
    from spes.eval.report import CSV_COLUMNS, csv_columns

    p = load_params(PARAMS_YAML)
    p.compare.variants = {"spes": [], "centralized": ["sync.method=centralized"]}
    p.compare.lrs = [0.002]
    results = [_result("spes", 0, 0.002, 3.0, metrics={"heldout_accuracy": 0.25, "x": 1.0}),
               _result("spes", 1, 0.002, 3.2, metrics={"heldout_accuracy": 0.5}),
               _result("centralized", 0, 0.002, 2.5), _result("centralized", 1, 0.002, 2.7)]  # run before metrics
    rows = {r["variant"]: r for r in summarize(p, results)["rows"]}
    assert rows["spes"]["heldout_accuracy_mean"] == 0.375 and "x_mean" not in rows["spes"]
    assert not any(k.endswith("_mean") and k not in CSV_COLUMNS for k in rows["centralized"])
    assert csv_columns(list(rows.values())) == CSV_COLUMNS + ["heldout_accuracy_mean"]
    md = report_markdown(p, summarize(p, results))
    assert "| variant | budget | heldout_accuracy |" in md and "| spes | 1 | 0.3750 |" in md
    assert "| centralized | 1 | - |" in md
    assert "Other metrics" not in report_markdown(p, summarize(p, [r for r in results if r["variant"] == "centralized"]))


def test_paired_difference_to_the_baseline():
    p = load_params(PARAMS_YAML)
    p.compare.variants = {"spes": [], "centralized": ["sync.method=centralized"]}
    p.compare.pairs = {}
    results = [_result("spes", 0, 0.002, 3.0, heldout_windows=[3.0, 2.0, 4.0]),
               _result("spes", 1, 0.002, 3.1, heldout_windows=[3.2, 2.1, 4.0]),
               _result("centralized", 0, 0.002, 2.9, heldout_windows=[2.9, 1.9, 3.9]),
               _result("centralized", 1, 0.002, 3.0, heldout_windows=[3.0, 2.0, 4.0])]
    rows = {r["variant"]: r for r in summarize(p, results)["rows"]}
    # seed 0: differences 0.1, 0.1, 0.1 (mean 0.1, SE 0); seed 1: 0.2, 0.1, 0.0 (mean 0.1, SE 0.1/sqrt(3))
    assert rows["spes"]["diff_to_baseline"] == pytest.approx(0.1)
    assert rows["spes"]["diff_to_baseline_se"] == pytest.approx((0.1 / 3**0.5) / 2)
    assert rows["centralized"]["diff_to_baseline"] == 0.0
    assert "| +0.1000 (0.0289) |" in report_markdown(p, summarize(p, results))
    no_windows = [dict(r, heldout_windows=None) for r in results]
    assert summarize(p, no_windows)["rows"][0]["diff_to_baseline"] is None


def test_the_seed_averaged_difference_is_clustered_by_document():
    """By hand: seeds 0 and 1 on the same two documents (windows 0,1 | 2,3). Per-window differences
    seed 0: 0.1, 0.3, -0.1, 0.1; seed 1: 0.3, 0.1, 0.1, -0.1; averaged over seeds: 0.2, 0.2, 0.0, 0.0
    (mean 0.1). Document sums of deviations: +0.2 and -0.2; SE = sqrt(2/1 x 0.08) / 4 = 0.1. Combining the
    seeds' own clustered SEs as if each had other documents (sqrt(0.1^2 + 0.1^2) / 2 = 0.0707) understates it."""
    from spes.eval.stats import paired_difference, seed_differences

    docs = [0, 0, 1, 1]
    ref = [_windows("b", s, [2.0, 2.0, 2.0, 2.0], docs) for s in (0, 1)]
    runs = [_windows("a", 0, [2.1, 2.3, 1.9, 2.1], docs), _windows("a", 1, [2.3, 2.1, 2.1, 1.9], docs)]
    assert [d for d, _ in seed_differences(runs, ref)] == pytest.approx([0.1, 0.1])
    assert [se for _, se in seed_differences(runs, ref)] == pytest.approx([0.1, 0.1])
    diff, se = paired_difference(runs, ref)
    assert diff == pytest.approx(0.1) and se == pytest.approx(0.1)


def test_the_t_quantile_matches_the_tables():
    from spes.eval.stats import t_quantile

    for df, q in ((1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (5, 2.5706), (10, 2.2281), (30, 2.0423)):
        assert t_quantile(df) == pytest.approx(q, abs=1e-4)
    assert t_quantile(1000) == pytest.approx(1.9623, abs=1e-4)
    assert t_quantile(3, 0.90) == pytest.approx(2.3534, abs=1e-4)
    with pytest.raises(DataError):
        t_quantile(0)


def _windows(variant, seed, windows, docs=(0, 0, 1, 1)):
    return _result(variant, seed, 0.002, sum(windows) / len(windows), heldout_windows=list(windows),
                   heldout_documents=list(docs))


def test_paired_comparisons_and_their_verdict():
    """compare.pairs: variant minus reference by seed and window; 'better'/'worse' only beyond twice the
    document-clustered SE, twice the SE over seeds and with every seed on one side."""

    from spes.eval.stats import clustered_se, verdict

    p = load_params(PARAMS_YAML)
    p.compare.variants = {"spes": [], "spes-no-merge": ["merge.enabled=false"], "spes-k1": ["merge.top_k=1"],
                          "spes-a02": ["merge.alpha_start=0.2"], "centralized": ["sync.method=centralized"]}
    p.compare.pairs = {"spes": "spes-no-merge", "spes-k1": "spes-no-merge", "spes-a02": "spes-no-merge"}
    check_matrix(p)
    ref = [1.0, 2.0, 3.0, 4.0]
    results = [_windows("spes-no-merge", 0, ref), _windows("spes-no-merge", 1, ref),
               _windows("centralized", 0, ref), _windows("centralized", 1, ref),
               # every window 0.2 (seed 0) and 0.3 (seed 1) lower: no window noise, seeds agree
               _windows("spes", 0, [x - 0.2 for x in ref]), _windows("spes", 1, [x - 0.3 for x in ref]),
               # the seeds disagree in sign
               _windows("spes-k1", 0, [x - 0.1 for x in ref]), _windows("spes-k1", 1, [x + 0.05 for x in ref]),
               # both seeds lower on average, but one document up and one down: within the window noise
               _windows("spes-a02", 0, [0.5, 1.5, 3.4, 4.4]), _windows("spes-a02", 1, [0.5, 1.5, 3.4, 4.4])]
    pairs = {x["variant"]: x for x in summarize(p, results)["pairs"]}
    a = pairs["spes"]
    assert (a["reference"], a["seeds"], a["lr"]) == ("spes-no-merge", 2, 0.002)
    assert a["per_seed"] == pytest.approx([-0.2, -0.3]) and a["diff"] == pytest.approx(-0.25)
    assert a["diff_se"] == pytest.approx(0.0, abs=1e-12) and a["seed_se"] == pytest.approx(0.05)
    # 2 seeds: beyond the t interval needs |diff| > t(1 df) 12.706 x 0.05 = 0.635
    assert a["verdict"] == "within noise"
    assert pairs["spes-k1"]["per_seed"] == pytest.approx([-0.1, 0.05]) and pairs["spes-k1"]["verdict"] == "within noise"
    c = pairs["spes-a02"]
    d = [-0.5, -0.5, 0.4, 0.4]
    assert c["diff"] == pytest.approx(-0.05) and c["seed_se"] == pytest.approx(0.0, abs=1e-12)
    # both seeds scored the same documents the same way: averaging seeds does not shrink the document noise
    assert c["diff_se"] == pytest.approx(clustered_se(d, [0, 0, 1, 1]))
    assert c["verdict"] == "within noise"
    assert verdict(-0.3, 0.1, [-0.3]) == "one seed"
    # seed SE 0.1/sqrt(2) = 0.0707: 0.3 is beyond 2 x 0.1 but not beyond 12.706 x 0.0707
    assert verdict(0.3, 0.1, [0.2, 0.4]) == "within noise"
    assert verdict(0.3, 0.01, [0.299, 0.301]) == "worse (< 4 seeds)"  # 0.3 > 12.706 x 0.001
    # 4 seeds (t for 3 df: 3.182): SE over seeds sqrt(0.02 / 3) / 2 = 0.0408, and 3.182 x 0.0408 = 0.130 < 0.3;
    # sqrt(0.17 / 3) / 2 = 0.1190, and 3.182 x 0.1190 = 0.379 > 0.3
    assert verdict(0.3, 0.1, [0.2, 0.3, 0.3, 0.4]) == "worse"
    assert verdict(0.3, 0.1, [0.05, 0.15, 0.45, 0.55]) == "within noise"
    md = report_markdown(p, summarize(p, results))
    assert "| spes | spes-no-merge | 1x | 0.002 | 2 | -0.2500 | 0.0000 | -0.2000, -0.3000 | 0.0500 | within noise |" in md
    p.compare.pairs = {"spes": "nope"}
    with pytest.raises(ConfigError, match=r"compare.pairs.spes: 'spes' -> 'nope' must name two different variants"):
        check_matrix(p)


def test_a_variant_set_against_several_references():
    """A pairs value may name several references, comma-separated: one row per reference, in that order,
    each paired on its own reference's windows; a misspelt one is named."""
    p = load_params(PARAMS_YAML)
    p.compare.variants = {"e16": [], "e8": [], "e4": []}
    p.compare.baseline = "e16"
    p.compare.pairs = {"e16": "e8, e4", "e8": "e4"}
    check_matrix(p)
    assert p.compare.pair_list() == [("e16", "e8"), ("e16", "e4"), ("e8", "e4")]
    results = [_windows("e4", s, [3.0, 3.0, 3.0, 3.0]) for s in (0, 1)] + \
              [_windows("e8", s, [2.9, 2.9, 2.9, 2.9]) for s in (0, 1)] + \
              [_windows("e16", s, [2.7, 2.7, 2.7, 2.7]) for s in (0, 1)]
    rows = [(x["variant"], x["reference"], round(x["diff"], 12)) for x in summarize(p, results)["pairs"]]
    assert rows == [("e16", "e8", -0.2), ("e16", "e4", -0.3), ("e8", "e4", -0.1)]
    p.compare.pairs = {"e16": "e8,e2"}
    with pytest.raises(ConfigError, match=r"compare.pairs.e16: 'e16' -> 'e2' must name two different variants"):
        check_matrix(p)


def test_a_preset_with_its_own_variants_drops_the_included_pairs(tmp_path):
    (tmp_path / "base.yaml").write_text(open(PARAMS_YAML).read())
    (tmp_path / "study.yaml").write_text("include: base.yaml\ncompare:\n  variants:\n    spes: []\n"
                                         "    centralized: [sync.method=centralized]\n")
    (tmp_path / "pairs.yaml").write_text("include: base.yaml\ncompare:\n  pairs: {spes-int8: spes}\n")
    assert load_params(PARAMS_YAML).compare.pairs == {"spes": "spes-no-merge", "diloco": "fedavg"}
    study = load_params(str(tmp_path / "study.yaml"))
    assert study.compare.pairs == {} and set(check_matrix(study)) == {"spes", "centralized"}
    assert load_params(str(tmp_path / "pairs.yaml")).compare.pairs == {"spes-int8": "spes"}  # replaced, not merged


@pytest.mark.parametrize("name", ["compare-lr.yaml", "compare-budget.yaml"])
def test_the_extra_comparisons_validate(name):
    p = load_params(os.path.join(os.path.dirname(PARAMS_YAML), "configs", name))
    assert set(check_matrix(p)) == {"spes", "centralized"}


@pytest.mark.parametrize("name,variants", [
    ("compare-churn.yaml", {"spes", "spes-churn", "centralized"}),
    ("compare-optstate.yaml", {"spes", "spes-avgopt", "fedavg", "fedavg-avgopt", "centralized"}),
    ("compare-memory.yaml", {"spes", "fedavg-e5", "diloco-e5", "centralized-e5", "centralized"})])
def test_the_studies_validate(name, variants):
    p = load_params(os.path.join(os.path.dirname(PARAMS_YAML), "configs", name))
    assert set(check_matrix(p)) == variants


@pytest.mark.parametrize("name,merging,init", [("compare-merge.yaml", 14, "upcycle"),
                                               ("compare-scratch.yaml", 4, "scratch"),
                                               ("compare-merge4.yaml", 1, "upcycle")])
def test_the_merging_studies_set_each_variant_against_its_no_merge_twin(name, merging, init):
    """compare-merge and compare-scratch: a pair differs in the merge settings only (same nodes, experts,
    batch and interval), and every variant that merges has its twin."""
    p = load_params(os.path.join(os.path.dirname(PARAMS_YAML), "configs", name))
    v = check_matrix(p)
    for variant, reference in p.compare.pairs.items():
        assert not v[reference].merge.enabled and v[variant].merge.enabled
        assert all(k.startswith("merge.") for k in _diff(v[variant], v[reference])), variant
    merges = {n for n, x in v.items() if x.sync.method == "spes" and x.merge.enabled}
    assert set(p.compare.pairs) == merges and len(merges) == merging
    assert {x.init.mode for x in v.values()} == {init}
    for eight in (x for n, x in v.items() if "8n16e" in n):
        assert (eight.model.num_experts, sync_method(eight).nodes) == (16, 8)


def test_equal_memory_per_node_the_largest_expert_count_that_fits():
    """compare-memory: the full-model methods at 5 experts fit what a SPES node of 8 experts holds; 6 would not;
    every variant's initial model differs only in its expert count."""
    from spes.train.plan import budget_bytes, node_peak_state

    p = load_params(os.path.join(os.path.dirname(PARAMS_YAML), "configs", "compare-memory.yaml"))
    v = check_matrix(p)
    budget = budget_bytes(p.compare.node_memory, v)
    assert budget == node_peak_state(v["spes"])
    assert all(node_peak_state(v[n]) <= budget for n in ("fedavg-e5", "diloco-e5", "centralized-e5"))
    assert node_peak_state(v["centralized"]) > budget
    six = variant_params(p, "fedavg-e5")
    six.model.num_experts = 6
    assert node_peak_state(six) > budget
    assert _diff(v["spes"], v["fedavg-e5"]) == {"sync.method", "model.num_experts"}
    assert budget_bytes("40MiB", v) == 40 * 2**20 and budget_bytes(None, v) is None
    with pytest.raises(ConfigError, match="compare.node_memory must be a variant .* or a size like 40MiB, got 'lots'"):
        budget_bytes("lots", v)


def test_the_report_marks_each_variant_within_the_memory_budget_or_over_it():
    p = load_params(PARAMS_YAML)
    p.compare.variants = {"spes": [], "centralized": ["sync.method=centralized"]}
    p.compare.pairs = {}
    p.compare.node_memory = "spes"
    results = [_result("spes", 0, 0.002, 3.0, memory_bytes_per_node=2 * 2**20, state_bytes_per_node=3 * 2**20,
                       num_experts=8),
               _result("centralized", 0, 0.002, 2.9, memory_bytes_per_node=4 * 2**20, num_experts=8)]
    s = summarize(p, results)
    s["node_memory"] = 2 * 2**20
    md = report_markdown(p, s)
    assert "Memory per node: at most 2.00 MiB of weights + gradients + Adam (compare.node_memory: spes)" in md
    rows = [line for line in md.splitlines() if line.startswith("| spes |") or line.startswith("| centralized |")]
    assert "| 2.00, 3.00 | yes |" in rows[0] and "| 4.00, - | no |" in rows[1]


def test_window_documents(tiny_tokens):
    import numpy as np

    from spes.data.tokens import TokenData, eval_batches, window_documents

    data = TokenData.open(tiny_tokens)
    seq = 16
    n = sum(len(x) for x, _ in eval_batches(data.val, 4, seq))
    docs = window_documents(data.val, data.eos_id, seq, n)
    val = np.asarray(data.val)
    for i in (0, n // 2, n - 1):  # the number of documents ended before the window's first token
        assert docs[i] == int((val[: i * seq] == data.eos_id).sum())
    assert docs == sorted(docs) and docs[-1] >= 1


def test_the_sync_interval_frontier_exact_numbers():
    p = load_params(os.path.join(os.path.dirname(PARAMS_YAML), "configs", "compare-sync.yaml"))
    resolved = check_matrix(p)  # every interval at equal tokens and equal warm-up steps
    assert {(v.sync.every_steps * v.sync.rounds, v.sync.every_steps * v.sync.warmup_rounds)
            for v in resolved.values()} == {(500, 200)}
    p.compare.seeds = [0]
    results = [_result(v, 0, 0.002, 3.0 + i / 10, bytes_per_node_per_round=1000.0 * (i + 1), tokens=1000)
               for i, v in enumerate(p.compare.variants)]
    s = summarize(p, results)
    front = {f["variant"]: f for f in s["frontier"]}
    assert "centralized" not in front and len(front) == 14
    # spes-s10 (index 1): 2000 bytes per round x 50 rounds over 1000 / 2 tokens per node
    assert front["spes-s10"]["bytes_per_node_per_token"] == 2000.0 * 50 / 500
    assert front["fedavg-s100"]["sync_steps"] == 100 and front["fedavg-s100"]["method"] == "fedavg"
    assert [(f["method"], f["sync_steps"]) for f in s["frontier"]] == [
        (m, k) for m in ("fedavg", "spes", "spes+avgopt", "spes+nesterov") for k in (10, 25, 50, 100)
        if (m, k) not in (("spes+avgopt", 10), ("spes+avgopt", 25))]
    assert "| spes | 1x | 10 | 1 | 3.1000 +- 0.0000 | - | - | 200.0 |" in report_markdown(p, s)  # no windows
    windows = [_result(v, 0, 0.002, 3.0 + i / 10, tokens=1000, heldout_windows=[3.0 + i / 10, 2.0 + i / 5])
               for i, v in enumerate(p.compare.variants)]
    front = {f["variant"]: f for f in summarize(p, windows)["frontier"]}
    # spes-s10 (index 1) minus spes (index 0), window by window: 0.1 and 0.2
    assert front["spes-s10"]["diff_to_base_interval"] == pytest.approx(0.15)
    assert front["spes"]["diff_to_base_interval"] == 0.0 and front["fedavg-s10"]["diff_to_base_interval"] == \
        pytest.approx(0.15)
    assert front["spes-nesterov-s10"]["diff_to_base_interval"] == pytest.approx(0.15)  # against spes-nesterov
    assert front["spes-avgopt-s100"]["diff_to_base_interval"] == pytest.approx(0.15)  # against spes-avgopt
    p.compare.variants = {"spes": [], "fedavg": ["sync.method=fedavg"], "centralized": ["sync.method=centralized"]}
    p.compare.pairs = {}
    assert summarize(p, results[:1] + results[4:5] + results[14:])["frontier"] == []  # one interval: no frontier


def test_window_documents_of_spread_windows(tiny_tokens):
    from spes.data.tokens import TokenData, eval_window_starts, window_documents

    data = TokenData.open(tiny_tokens)
    seq = 32
    every = window_documents(data.val, data.eos_id, seq, (len(data.val) - 1) // seq)
    starts = eval_window_starts(len(data.val), seq, 8, spread=True)
    assert window_documents(data.val, data.eos_id, seq, 8, starts) == [every[s // seq] for s in starts]
    assert len(set(window_documents(data.val, data.eos_id, seq, 8, starts))) >= \
        len(set(window_documents(data.val, data.eos_id, seq, 8)))


def test_how_far_the_per_round_slice_agrees_with_the_whole_split():
    from spes.eval.compare import slice_agreement

    def res(slice_loss, whole, windows="spread"):
        return {"curve": [{"round": 2, "heldout_loss": slice_loss}], "rounds": 2, "heldout_loss": whole,
                "round_windows": windows}

    sl = slice_agreement([res(4.0, 4.1), res(4.2, 4.3), res(4.5, 4.25), {"curve": [], "rounds": 2}])
    assert sl["runs"] == 3 and sl["round_windows"] == ["spread"]
    assert sl["mean_diff"] == pytest.approx((-0.1 - 0.1 + 0.25) / 3) and sl["max_abs_diff"] == pytest.approx(0.25)
    assert sl["pairs_same_order"] == pytest.approx(2 / 3)  # (1,2), (1,3) agree; (2,3) do not
    assert slice_agreement([res(4.0, 4.1)]) is None


def test_paired_differences_round_by_round_on_the_rounds_slice():
    """The hand example above (seed-averaged difference 0.1, document-clustered SE 0.1) as round 2's slice of
    two runs per variant; round 1 differs by exactly 0.5 in every window (SE 0); a run whose records did not
    keep the windows (round 3 of seed 1) leaves that round to the seed that has them."""
    p = load_params(PARAMS_YAML)
    p.compare.variants = {"a": [], "b": ["merge.enabled=false"]}
    p.compare.baseline, p.compare.pairs, p.compare.lrs = "b", {"a": "b"}, [0.002]
    docs = [0, 0, 1, 1]

    def run(variant, seed, r2, r1=1.5, r3=None):
        curve = [{"round": 1, "tokens": 100, "heldout_loss": r1, "windows": [r1] * 4},
                 {"round": 2, "tokens": 200, "heldout_loss": sum(r2) / 4, "windows": r2},
                 {"round": 3, "tokens": 300, "heldout_loss": 2.0} | ({"windows": r3} if r3 else {})]
        return _result(variant, seed, 0.002, 2.0, curve=curve, round_window_documents=docs)

    results = [run("b", 0, [2.0] * 4, 1.0, [2.0] * 4), run("b", 1, [2.0] * 4, 1.0),
               run("a", 0, [2.1, 2.3, 1.9, 2.1], r3=[2.5] * 4), run("a", 1, [2.3, 2.1, 2.1, 1.9])]
    rows = {x["round"]: x for x in summarize(p, results)["round_pairs"]}
    assert sorted(rows) == [1, 2, 3]
    assert rows[1]["diff"] == pytest.approx(0.5) and rows[1]["diff_se"] == pytest.approx(0.0)
    assert rows[2]["diff"] == pytest.approx(0.1) and rows[2]["diff_se"] == pytest.approx(0.1)
    assert rows[2]["doc_diff"] == pytest.approx(0.1) and rows[2]["seeds"] == 2 and rows[2]["tokens"] == 200
    assert rows[3]["seeds"] == 1 and rows[3]["diff"] == pytest.approx(0.5)
    assert rows[3]["verdict"] == "one seed"  # no claim
    text = report_markdown(p, summarize(p, results))
    assert "## Paired comparisons round by round" in text and "| a | b | 1x | 0.002 | 2 | 200 | 2 | +0.1000 | 0.1000 |" in text
