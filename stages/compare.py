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
from stages.study_dvc import dvcfile_of, write_dvcfile


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
    tokens, curve = _curve(records)
    rows = [n for rec in records for n in rec.nodes if n.ok]
    mem = node_memory(dataclasses.replace(vp, model=model.cfg), 0)  # the trained model's own config
    result = {"variant": cell.variant, "seed": cell.seed, "lr": cell.lr, "budget": cell.budget, "run": cell.run_name,
              "rounds": last, "train_tokens": len(data.train), "heldout_loss": ev["loss"], "heldout_se": ev["se"], "eval_tokens": ev["tokens"],
              "heldout_windows": ev["per_window"], "heldout_documents": docs, "tokens": tokens, "trainable_params_per_node": mem["trainable_params"],
              "memory_bytes_per_node": mem["total_bytes"],
              "peak_bytes_per_node": max((n.upload.peak_bytes or 0 for n in rows), default=0) or None,
              "state_bytes_per_node": max((n.upload.state_bytes or 0 for n in rows), default=0) or None,
              "num_experts": vp.model.num_experts,
              "bytes_per_node_per_round": sum(n.bytes_up + n.bytes_down for n in rows) / max(1, len(rows)),
              "wall_s": sum(rec.wall_s for rec in records), "curve": curve, "round_windows": p.eval.round_windows,
              "metrics": {"heldout_accuracy": ev["accuracy"]},
              "round_window_documents": round_window_documents(p, data), "machine": machine_kind()}
    os.makedirs(a.out, exist_ok=True)
    write_json(os.path.join(a.out, "result.json"), result)
    print(f"compare: {cell.run_name}: held-out loss {ev['loss']:.4f} (SE {ev['se']:.4f}) after {tokens} tokens")


def _curve(records) -> tuple[int, list[dict]]:
    """The run's tokens and its per-round held-out curve, with each window of the round's slice where the
    record kept them."""
    tokens, curve = 0, []
    for rec in records:
        tokens += rec.tokens
        if rec.heldout_loss is not None:
            curve.append({"round": rec.round, "tokens": tokens, "heldout_loss": rec.heldout_loss,
                          **({"windows": rec.heldout_windows} if rec.heldout_windows else {})})
    return tokens, curve


def machine_kind() -> str:
    """What decides this cell's numerics to the last digit: the CPU model, the kernels torch runs (the library
    pins AVX2 on x86-64, spes/__init__.py) and the torch build. Reports must not mix cells of two kinds."""
    import platform

    import torch

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}"


def round_window_documents(p, data) -> list[int]:
    """The document of each window of the per-round held-out slice (eval.round_batches x batch_size windows,
    spread or first), in the order the round records keep their losses."""
    from spes.data.tokens import window_documents
    from spes.eval.heldout import heldout_windows

    starts = heldout_windows(p.eval, data, per_round=True)
    return window_documents(data.val, data.eos_id, p.eval.seq_len, len(starts), starts)


def report(a) -> None:
    from spes.eval.compare import cells, summarize
    from spes.eval.report import PAIR_COLUMNS, csv_columns, report_markdown

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
        raise MissingInput(f"report: no result for {missing} (run `dvc repro {dvcfile_of(a.params)}`)")
    _fill_train_tokens(p, results)
    summary = summarize(p, results)
    summary["node_memory"] = node_memory
    md = report_markdown(p, summary)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "report.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=csv_columns(summary["rows"]), extrasaction="ignore")
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


def _fill_train_tokens(p, results: list[dict]) -> None:
    """Results made before they recorded the training split's size get it from the study's token index, which
    made them (the report's epochs over the training split); left out where that index is not here."""
    meta = os.path.join(p.artifacts_dir, "tokens", "meta.json")
    if all("train_tokens" in r for r in results) or not os.path.exists(meta):
        return
    with open(meta) as f:
        train = json.load(f)["splits"]["train"]["tokens"]
    for r in results:
        r.setdefault("train_tokens", train)


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
