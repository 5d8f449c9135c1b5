"""DVC stages of compare/dvc.yaml: SPES against its baselines at equal tokens.

    python -m stages.compare run --variant V --seed S --lr LR --budget B --out DIR
        one cell of the matrix as its own run (cmp-<V>-<S>-<LR>-<B>) from the main pipeline's tokens and
        initial model; DIR/result.json: held-out loss (whole split, with its standard error and the loss of
        every window), tokens, per-node trainable params and memory, bytes on the wire per node per round,
        wall time, the held-out curve
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

from stages.common import prefect_env_defaults, run, write_json


def _load(params_path: str):
    """The params, every variant checked before anything trains, and the memory budget in bytes (or None)."""
    from spes.config.loader import load_params
    from spes.eval.compare import check_matrix
    from spes.train.plan import budget_bytes

    p = load_params(params_path)
    return p, budget_bytes(p.compare.node_memory, check_matrix(p))


def _variant_init(p, vp, folder: str) -> str:
    """The initial model of a variant with another expert count than the main pipeline's: the same init
    recipe (init.*: upcycled from the same dense model, or from scratch) at its expert count; else the main
    pipeline's artifacts/init."""
    main_init = os.path.join(p.artifacts_dir, "init", "model.safetensors")
    if vp.model.num_experts == p.model.num_experts:
        return main_init
    import torch
    from safetensors.torch import save_file

    from spes.model.hf import load_hf
    from spes.model.transformer import CausalLM
    from spes.model.upcycle import upcycle

    torch.manual_seed(p.init.seed)
    if p.init.mode == "scratch":
        model = CausalLM(vp.model)
    else:
        dense = load_hf(p.init.dense_checkpoint or os.path.join(p.artifacts_dir, "dense", "hf"))
        model = upcycle(dense, vp.model, p.init.noise_std, p.init.noise_fraction, p.init.router_init_std,
                        p.init.seed)
    path = os.path.join(folder, "model.safetensors")  # the upcycle stage's layout: InitModel.load reads both
    save_file(model.canonical_state_dict(), path)
    write_json(os.path.join(folder, "config.json"), {"model_config": dataclasses.asdict(model.cfg),
                                                      "source": f"{p.init.mode} ({vp.model.num_experts} experts)"})
    return path


def run_cell(a) -> None:
    import torch

    from spes.data.tokens import TokenData, window_documents
    from spes.eval.compare import Cell, clustered_se, variant_params
    from spes.eval.heldout import heldout_loss
    from spes.run.run import Run
    from spes.storage.store import Store
    from spes.train.plan import node_memory

    p, _ = _load(a.params)
    if a.variant not in p.compare.variants:
        raise SystemExit(f"compare: no variant {a.variant!r} in compare.variants ({sorted(p.compare.variants)})")
    cell = Cell(a.variant, int(a.seed), float(a.lr), int(a.budget))
    vp = variant_params(p, cell.variant, cell.seed, cell.lr, cell.budget)
    overrides = list(p.compare.variants[cell.variant]) + [
        f"spes.seed={cell.seed}", f"spes.optim.lr={cell.lr}", f"spes.rounds={vp.spes.rounds}",
        f"orchestration.run_name={cell.run_name}"]
    prefect_env_defaults()
    from pipelines.node_pool import POOL
    from pipelines.prefect_api import prefect_api
    from spes.sync.methods import sync_method

    POOL.start(range(sync_method(vp.spes).nodes))
    with prefect_api(), tempfile.TemporaryDirectory() as tmp:
        from pipelines.training import spes_training

        spes_training(params_path=a.params, overrides=overrides, stage="all", run_name=cell.run_name,
                      init_path=_variant_init(p, vp, tmp), on_mismatch="restart")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    run_ = Run(Store.from_config(vp.storage), cell.run_name)
    last = run_.latest_round()
    model, _ = run_.load_model(last)
    data = TokenData.open(os.path.join(p.artifacts_dir, "tokens"))
    ev = heldout_loss(model, data.val, p.eval.batch_size, p.eval.seq_len)
    docs = window_documents(data.val, data.eos_id, p.eval.seq_len, ev["windows"])
    ev["se"] = clustered_se(ev["per_window"], docs)  # windows of one document are not independent
    records = run_.records(1, last)
    tokens, curve = 0, []
    for rec in records:
        tokens += rec.tokens
        if rec.heldout_loss is not None:
            curve.append({"round": rec.round, "tokens": tokens, "heldout_loss": rec.heldout_loss})
    rows = [n for rec in records for n in rec.nodes if n.ok]
    mem = node_memory(model.cfg, vp.spes, 0)
    result = {"variant": cell.variant, "seed": cell.seed, "lr": cell.lr, "budget": cell.budget, "run": cell.run_name,
              "rounds": last, "heldout_loss": ev["loss"], "heldout_se": ev["se"], "eval_tokens": ev["tokens"],
              "heldout_windows": ev["per_window"],
              "heldout_documents": docs,
              "tokens": tokens, "trainable_params_per_node": mem["trainable_params"],
              "memory_bytes_per_node": mem["total_bytes"],
              "peak_bytes_per_node": max((n.upload.peak_bytes or 0 for n in rows), default=0) or None,
              "state_bytes_per_node": max((n.upload.state_bytes or 0 for n in rows), default=0) or None,
              "num_experts": vp.model.num_experts,
              "bytes_per_node_per_round": sum(n.bytes_up + n.bytes_down for n in rows) / max(1, len(rows)),
              "wall_s": sum(rec.wall_s for rec in records), "curve": curve, "round_windows": p.eval.round_windows}
    os.makedirs(a.out, exist_ok=True)
    write_json(os.path.join(a.out, "result.json"), result)
    print(f"compare: {cell.run_name}: held-out loss {ev['loss']:.4f} (SE {ev['se']:.4f}) after {tokens} tokens")


def report(a) -> None:
    from spes.eval.compare import CSV_COLUMNS, PAIR_COLUMNS, cells, report_markdown, summarize

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
        raise SystemExit(f"compare report: no result for {missing} (run `dvc repro compare/dvc.yaml`)")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    for k in ("variant", "seed", "lr", "budget", "out"):
        r.add_argument(f"--{k}", required=True)
    rep = sub.add_parser("report")
    rep.add_argument("--dir", default=None, help="where the cells' results are (runs/) and the report goes")
    for s in (r, rep):
        s.add_argument("--params", default="params.yaml")
    a = ap.parse_args()
    (run_cell if a.cmd == "run" else report)(a)


if __name__ == "__main__":
    sys.argv[0] = "compare"
    run(main)
