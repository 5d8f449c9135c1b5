"""DVC stages of compare/dvc.yaml: SPES against its baselines at equal tokens.

    python -m stages.compare run --variant V --seed S --lr LR --budget B --out DIR
        one cell of the matrix as its own run (cmp-<V>-<S>-<LR>-<B>) from the main pipeline's tokens and
        initial model; DIR/result.json: held-out loss (whole split, with its standard error and the loss of
        every window), tokens, per-node trainable params and memory, bytes on the wire per node per round,
        wall time, the held-out curve
    python -m stages.compare dvcfile --params configs/compare-<study>.yaml
        compare/<study>/dvc.yaml: the study's cells and report as DVC stages (results under
        artifacts/compare-<study>/), so `dvc repro compare/<study>/dvc.yaml` reproduces it
    python -m stages.compare report [--dir DIR]
        DIR/report.md, report.csv, pairs.csv (compare.pairs), heldout_curves.csv (dvc plots) and .svg (offline)
        from DIR/runs/<cell>/result.json (DIR:
        artifacts/compare), and the table as a Prefect markdown artifact
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys
import tempfile

from spes.errors import MissingInput, ModelError, UsageError
from stages.common import prefect_env_defaults, run, write_json


def _load(params_path: str):
    """The params, every variant checked before anything trains, and the memory budget in bytes (or None)."""
    from spes.config.loader import load_params
    from spes.eval.compare import check_matrix
    from spes.train.plan import budget_bytes

    p = load_params(params_path)
    return p, budget_bytes(p.compare.node_memory, check_matrix(p))


def _variant_init(p, vp, folder: str) -> str:
    """The initial model of a variant: the main pipeline's artifacts/init when its record says the study's
    init recipe (init.*) made it at the variant's expert count; else made anew by that recipe (the same dense
    model upcycled to another count, or a study from scratch) into `folder`."""
    from safetensors.torch import save_file

    from spes.model.initial import init_record, init_source, initial_model, made_by

    main = os.path.join(p.artifacts_dir, "init")
    record_path = os.path.join(main, "config.json")
    if not os.path.exists(record_path):  # the flow's InitModel.load then names the stage to run
        return os.path.join(main, "model.safetensors")
    try:
        with open(record_path) as f:
            record = json.load(f)
    except ValueError as e:  # damaged: never silently taken for another recipe's model
        raise ModelError(f"{record_path}: not an initial model's config ({e})") from None
    if not isinstance(record, dict):
        raise ModelError(f"{record_path}: not an initial model's config (a JSON object)")
    source = init_source(vp.init, p.artifacts_dir)
    if made_by(record, vp.model, vp.init, source):
        return os.path.join(main, "model.safetensors")
    model, _ = initial_model(vp.model, vp.init, p.artifacts_dir)
    path = os.path.join(folder, "model.safetensors")  # the upcycle stage's layout: InitModel.load reads both
    save_file(model.canonical_state_dict(), path)
    write_json(os.path.join(folder, "config.json"), init_record(model, vp.init, source))
    return path


def run_cell(a) -> None:
    import torch

    from spes.data.tokens import TokenData, window_documents
    from spes.eval.compare import Cell, variant_params
    from spes.eval.heldout import heldout_loss, heldout_windows
    from spes.eval.stats import clustered_se
    from spes.run.run import Run
    from spes.train.plan import node_memory

    p, _ = _load(a.params)
    if a.variant not in p.compare.variants:
        raise UsageError(f"no variant {a.variant!r} in compare.variants ({sorted(p.compare.variants)})")
    cell = Cell(a.variant, int(a.seed), float(a.lr), int(a.budget))
    vp = variant_params(p, cell.variant, cell.seed, cell.lr, cell.budget)
    overrides = list(p.compare.variants[cell.variant]) + [
        f"train.seed={cell.seed}", f"train.optim.lr={cell.lr}", f"sync.rounds={vp.sync.rounds}",
        f"orchestration.run_name={cell.run_name}"]
    prefect_env_defaults()
    from pipelines.node_pool import POOL
    from pipelines.prefect_api import prefect_api
    from spes.train.planned_nodes import planned_nodes

    POOL.start(range(planned_nodes(vp).count))
    with prefect_api(), tempfile.TemporaryDirectory() as tmp:
        from pipelines.training import spes_training

        spes_training(params_path=a.params, overrides=overrides, stage="all", run_name=cell.run_name,
                      init_path=_variant_init(p, vp, tmp), on_mismatch="restart")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    run_ = Run.open(vp.storage, cell.run_name)
    last = run_.latest_round()
    model, _ = run_.load_model(last)
    data = TokenData.open(os.path.join(p.artifacts_dir, "tokens"))
    starts = heldout_windows(p.eval, data, whole=True)
    ev = heldout_loss(model, data.val, p.eval.batch_size, p.eval.seq_len, starts=starts)
    docs = window_documents(data.val, data.eos_id, p.eval.seq_len, len(starts), starts)
    ev["se"] = clustered_se(ev["per_window"], docs)  # windows of one document are not independent
    records = run_.records(1, last)
    tokens, curve = 0, []
    for rec in records:
        tokens += rec.tokens
        if rec.heldout_loss is not None:  # with each window of the round's slice where the record kept them
            curve.append({"round": rec.round, "tokens": tokens, "heldout_loss": rec.heldout_loss,
                          **({"windows": rec.heldout_windows} if rec.heldout_windows else {})})
    rows = [n for rec in records for n in rec.nodes if n.ok]
    mem = node_memory(dataclasses.replace(vp, model=model.cfg), 0)  # the trained model's own config
    result = {"variant": cell.variant, "seed": cell.seed, "lr": cell.lr, "budget": cell.budget, "run": cell.run_name,
              "rounds": last, "heldout_loss": ev["loss"], "heldout_se": ev["se"], "eval_tokens": ev["tokens"],
              "heldout_windows": ev["per_window"], "heldout_documents": docs, "tokens": tokens, "trainable_params_per_node": mem["trainable_params"],
              "memory_bytes_per_node": mem["total_bytes"],
              "peak_bytes_per_node": max((n.upload.peak_bytes or 0 for n in rows), default=0) or None,
              "state_bytes_per_node": max((n.upload.state_bytes or 0 for n in rows), default=0) or None,
              "num_experts": vp.model.num_experts,
              "bytes_per_node_per_round": sum(n.bytes_up + n.bytes_down for n in rows) / max(1, len(rows)),
              "wall_s": sum(rec.wall_s for rec in records), "curve": curve, "round_windows": p.eval.round_windows,
              "round_window_documents": round_window_documents(p, data)}
    os.makedirs(a.out, exist_ok=True)
    write_json(os.path.join(a.out, "result.json"), result)
    print(f"compare: {cell.run_name}: held-out loss {ev['loss']:.4f} (SE {ev['se']:.4f}) after {tokens} tokens")


def round_window_documents(p, data) -> list[int]:
    """The document of each window of the per-round held-out slice (eval.round_batches x batch_size windows,
    spread or first), in the order the round records keep their losses."""
    from spes.data.tokens import window_documents
    from spes.eval.heldout import heldout_windows

    starts = heldout_windows(p.eval, data, per_round=True)
    return window_documents(data.val, data.eos_id, p.eval.seq_len, len(starts), starts)


def report(a) -> None:
    from spes.eval.compare import CSV_COLUMNS, PAIR_COLUMNS, cells, summarize
    from spes.eval.report import report_markdown

    p, node_memory = _load(a.params)
    out = a.dir or os.path.join(p.artifacts_dir, "compare")
    runs_dir = os.path.join(out, "runs")
    results, missing = [], []
    for cell in cells(p):
        f = os.path.join(runs_dir, cell.key, "result.json")
        if not os.path.exists(f):
            missing.append(cell.key)
            continue
        with open(f) as fh:
            results.append(json.load(fh))
    if missing:
        raise MissingInput(f"report: no result for {missing} (run `dvc repro compare/dvc.yaml`)")
    summary = summarize(p, results)
    summary["node_memory"] = node_memory
    md = report_markdown(p, summary)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "report.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(summary["rows"])
    with open(os.path.join(out, "pairs.csv"), "w", newline="") as f:  # written (maybe empty): a DVC out
        w = csv.DictWriter(f, fieldnames=PAIR_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows({**x, "per_seed": " ".join(f"{d:.6f}" for d in x["per_seed"])} for x in summary["pairs"])
    curves = _write_curves(os.path.join(out, "heldout_curves.csv"), summary["rows"], results)
    from spes.eval.svg_plot import line_plot_svg, series_of

    with open(os.path.join(out, "heldout_curves.svg"), "w") as f:  # opens offline, unlike `dvc plots show`
        f.write(line_plot_svg(series_of(curves, lambda c: c["series"], "tokens", "heldout_loss"),
                              "held-out loss vs tokens (mean over seeds, best lr)", "tokens", "held-out loss"))
    if summary["frontier"]:  # variants syncing at different intervals: loss against traffic, a line per method
        lines = series_of(summary["frontier"], lambda f: f"{f['method']} ({f['budget']}x)",
                          "bytes_per_node_per_token", "heldout_loss_mean")
        with open(os.path.join(out, "frontier.svg"), "w") as f:
            f.write(line_plot_svg(lines, "held-out loss against bytes per node per token (points: sync_steps)",
                                  "bytes on the wire per node per training token", "held-out loss"))
    prefect_env_defaults()
    from pipelines.prefect_api import prefect_api

    with prefect_api():
        from pipelines.compare import publish_report

        publish_report(md)
    print(md)


def _write_curves(path: str, rows: list[dict], results: list[dict]) -> list[dict]:
    """Held-out loss vs tokens of each reported (best-lr) variant, mean over seeds, long format for dvc plots."""
    out = []
    for row in rows:
        runs = [r for r in results if (r["variant"], r["budget"], r["lr"]) == (row["variant"], row["budget"], row["lr"])]
        for i, point in enumerate(runs[0]["curve"]):
            loss = sum(r["curve"][i]["heldout_loss"] for r in runs) / len(runs)
            out.append({"series": f"{row['variant']} ({row['budget']}x)", "tokens": point["tokens"],
                        "heldout_loss": loss})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["series", "tokens", "heldout_loss"])
        w.writeheader()
        w.writerows(out)
    return out


STUDY_PREFIX = "compare-"


def study_name(params_path: str) -> str:
    """configs/compare-merge.yaml -> 'merge': where its DVC file (compare/merge/) and results go."""
    base = os.path.splitext(os.path.basename(params_path))[0]
    if not base.startswith(STUDY_PREFIX) or base == STUDY_PREFIX:
        raise UsageError(f"dvcfile: {params_path} is not a study preset (configs/{STUDY_PREFIX}<study>.yaml)")
    return base[len(STUDY_PREFIX):]


def study_dvcfile(params_path: str) -> dict:
    """The DVC stages of one study preset: the matrix of its cells, written out (a preset inherits some of
    compare.* from params.yaml, which DVC's `vars` cannot follow), each cell a run stage, then the report;
    the layout of compare/dvc.yaml, with the preset's file as a params dependency beside params.yaml's."""
    from spes.config.loader import load_params
    from spes.eval.compare import check_matrix, has_frontier

    p = load_params(params_path)
    resolved = check_matrix(p)  # every variant checked, once
    preset = params_path.replace(os.sep, "/")
    out = f"artifacts/{STUDY_PREFIX}{study_name(params_path)}"
    c = p.compare
    run_params = [{preset: []}, {"params.yaml": ["model", "sync", "train", "outer", "merge", "data", "eval"]}]
    report_outs = ["report.md", "report.csv", "pairs.csv", "heldout_curves.csv", "heldout_curves.svg"]
    if has_frontier(resolved):
        report_outs.append("frontier.svg")
    data = p.artifacts_dir.rstrip("/")
    return {
        "stages": {
            **(_data_stages(preset, data) if data != MAIN_ARTIFACTS else {}),
            "run": {
                "matrix": {"variant": list(c.variants), "seed": list(c.seeds), "lr": list(c.lrs),
                           "budget": list(c.budgets)},
                "wdir": "../..",
                "cmd": f"python -m stages.compare run --params {preset} --variant ${{item.variant}} --seed "
                       f"${{item.seed}} --lr ${{item.lr}} --budget ${{item.budget}} --out {out}/runs/${{key}}",
                "deps": ["stages/compare.py", "stages/rounds.py", "spes", "pipelines", f"{data}/tokens",
                         f"{data}/init"],
                "params": run_params,
                "outs": [{f"{out}/runs/${{key}}/result.json": {"cache": False}}]},
            "report": {
                "wdir": "../..",
                "cmd": f"python -m stages.compare report --params {preset} --dir {out}",
                "deps": ["stages/compare.py", "spes/eval/compare.py", f"{out}/runs"],
                "params": [{preset: []}],
                "outs": [{f"{out}/{name}": {"cache": False}} for name in report_outs]}},
        "plots": [{"heldout loss vs tokens": {"template": "compare_lines", "x": "tokens",
                                              "y": {f"../../{out}/heldout_curves.csv": "heldout_loss"}}}]}


MAIN_ARTIFACTS = "artifacts"
"""The main pipeline's artifacts_dir: a study whose preset names another makes its own tokens, dense model
and initial model there (its own corpus), by the main pipeline's stages run on the preset."""


def _data_stages(preset: str, data: str) -> dict:
    def stage(name: str, deps: list[str], out: str, numbers: str = "") -> dict:
        figures = {"outs": [{f"{data}/{numbers}/timings.json": {"cache": False}}],  # as dvc.yaml's stages
                   "metrics": [{f"{data}/{numbers}/metrics.json": {"cache": False}}]} if numbers else {"outs": []}
        return {"wdir": "../..", "cmd": f"python -m stages.{name} --params {preset}", "deps": [f"stages/{name}.py", *deps],
                "params": [{preset: []}, {"params.yaml": ["tokenize", "model", "dense", "init", "data", "eval"]}],
                **figures, "outs": [f"{data}/{out}", *figures["outs"]]}

    return {"tokenize": stage("tokenize", ["spes/data"], "tokens", "tokenize"),
            "dense": stage("dense", ["spes/model", "spes/train", f"{data}/tokens"], "dense/hf", "dense"),
            "upcycle": stage("upcycle", ["spes/model", f"{data}/dense/hf", f"{data}/tokens"], "init")}


def write_dvcfile(a) -> None:
    import yaml

    body = yaml.safe_dump(study_dvcfile(a.params), sort_keys=False, width=1000)
    path = os.path.join("compare", study_name(a.params), "dvc.yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"# Made by `python -m stages.compare dvcfile --params {a.params}`: do not edit, regenerate.\n"
                f"# `dvc repro {path}` runs this study's cells and report (see {a.params}).\n" + body)
    print(f"compare: wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    for k in ("variant", "seed", "lr", "budget", "out"):
        r.add_argument(f"--{k}", required=True)
    rep = sub.add_parser("report")
    rep.add_argument("--dir", default=None, help="where the cells' results are (runs/) and the report goes")
    gen = sub.add_parser("dvcfile")
    for s in (r, rep, gen):
        s.add_argument("--params", default="params.yaml")
    a = ap.parse_args()
    {"run": run_cell, "report": report, "dvcfile": write_dvcfile}[a.cmd](a)


if __name__ == "__main__":
    sys.argv[0] = "compare"
    run(main)
