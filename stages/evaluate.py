"""DVC stage `evaluate`: held-out loss of the final model (and of round 0 and an untrained model), the curve
of held-out loss per round from the round records, HF export with the tokenizer and a logit-parity check,
optional lm-eval tasks.

Reads the run's committed rounds on shared storage and artifacts/tokens; writes artifacts/eval/metrics.json,
heldout_loss.csv, node_loss.csv, the same curves as SVG pictures (heldout_loss.svg, node_loss.svg: they open
offline, where `dvc plots show` needs its CDN) and hf/ (the exported model with its tokenizer).
Example: python -m stages.evaluate eval.batches=50
"""
from __future__ import annotations

import csv
import os
import sys

from spes.errors import MissingInput
from stages.common import out_dir, parse, run, write_json

UNTRAINED_SEED_OFFSET = 1
"""The untrained reference model is a fresh init with seed init.seed + 1, not the run's own init."""


def _write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


def _write_svgs(d: str, per_round: list[dict], node_rows: list[dict]) -> None:
    """The two plots as SVG files beside their CSVs (`dvc plots show` needs a CDN; these open offline)."""
    from spes.eval.svg_plot import line_plot_svg, series_of

    plots = {"heldout_loss.svg": (series_of(per_round, lambda r: "held-out loss", "step", "heldout_loss"),
                                  "held-out loss per round", "step", "held-out loss",
                                  "no held-out evaluation during the rounds (eval.every_rounds: 0)"),
             "node_loss.svg": (series_of(sorted(node_rows, key=lambda r: r["node"]), lambda r: f"node {r['node']}",
                                         "round", "train_loss"),
                               "train loss per round, per node", "round", "mean train loss", "no round records")}
    for name, (series, title, xlabel, ylabel, empty) in plots.items():
        with open(os.path.join(d, name), "w") as f:
            f.write(line_plot_svg(series, title, xlabel, ylabel, empty))


def main() -> None:
    _, p = parse(__doc__)
    import torch

    from spes.data.tokenization import hf_tokenizer
    from spes.data.tokens import TokenData
    from spes.eval.heldout import heldout_loss, heldout_windows, run_lm_eval
    from spes.model.hf import export_hf, to_hf
    from spes.model.transformer import CausalLM
    from spes.run.run import Run
    from spes.train.devices import resolve_device

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    d = out_dir(p, "eval")
    e = p.eval
    run = Run.open(p.storage, p.orchestration.run_name)
    data = TokenData.open(os.path.join(p.artifacts_dir, "tokens"))
    rounds = run.committed_rounds()
    if not rounds:
        raise MissingInput(f"run {run.name!r} has no committed rounds on {run.store.url}")
    device = resolve_device(p.orchestration.device)

    def evaluate(model, what: str):
        return heldout_loss(model.to(device), data.val, e.batch_size, e.seq_len, progress=f"evaluate: {what}",
                            starts=heldout_windows(e, data))

    initial = evaluate(run.load_model(0)[0], "the initial model (round 0)")["loss"]
    model, manifest = run.load_model(rounds[-1])
    final = evaluate(model, f"the final model (round {rounds[-1]})")
    torch.manual_seed(p.init.seed + UNTRAINED_SEED_OFFSET)
    untrained = evaluate(CausalLM(model.cfg), "an untrained model")["loss"]
    model.to("cpu")

    per_round, node_rows, tokens = [], [], 0
    for rec in run.records(1, rounds[-1]):
        tokens += rec.tokens
        if rec.heldout_loss is not None:
            per_round.append({"round": rec.round, "step": rec.aggregate.step, "tokens": tokens,
                              "heldout_loss": rec.heldout_loss})
        for node, loss in sorted(rec.aggregate.node_loss.items()):
            node_rows.append({"round": rec.round, "node": node, "train_loss": loss})

    hf_dir = os.path.join(d, "hf")
    export_hf(model, hf_dir, hf_tokenizer(os.path.join(p.artifacts_dir, "tokens", "tokenizer.json")))
    x = torch.from_numpy(data.val.read(0, 2 * e.seq_len).astype("int64")).view(2, e.seq_len)
    with torch.no_grad():
        parity = (to_hf(model)(x).logits - model(x).logits).abs().max().item()
    metrics = {"final_round": rounds[-1], "heldout_loss": final["loss"], "heldout_perplexity": final["perplexity"],
               "heldout_accuracy": final["accuracy"],
               "untrained_heldout_loss": untrained, "initial_heldout_loss": initial,
               "hf_max_abs_logit_diff": parity, "eval_tokens": final["tokens"], "train_tokens": tokens}
    if e.lm_eval_tasks:
        print(f"evaluate: lm-eval tasks {list(e.lm_eval_tasks)} on the exported model", file=sys.stderr, flush=True)
        metrics["lm_eval"] = run_lm_eval(hf_dir, list(e.lm_eval_tasks), e.lm_eval_include, e.lm_eval_limit)
    write_json(os.path.join(d, "metrics.json"), metrics)
    _write_csv(os.path.join(d, "heldout_loss.csv"), per_round)
    _write_csv(os.path.join(d, "node_loss.csv"), node_rows)
    _write_svgs(d, per_round, node_rows)
    print(f"evaluate: {metrics}")


if __name__ == "__main__":
    run(main)
