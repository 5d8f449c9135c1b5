"""DVC stage `evaluate`: held-out loss of every committed round (vs the untrained model), HF export with the
tokenizer and a logit-parity check, optional lm-eval tasks; writes metrics.json and plot CSVs."""
from __future__ import annotations

import csv
import os

from stages.common import out_dir, parse, write_json

UNTRAINED_SEED_OFFSET = 1
"""The untrained reference model is a fresh init with seed init.seed + 1, not the run's own init."""


def main() -> None:
    _, p = parse(__doc__)
    import torch

    from spes.data import TokenData
    from spes.devices import resolve_device
    from spes.evaluation import heldout_loss, run_lm_eval
    from spes.hf import export_hf, to_hf
    from spes.rounds import load_global
    from spes.runs import Run
    from spes.store import Store

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    d = out_dir(p, "eval")
    e, run = p.eval, p.orchestration.run_name
    data = TokenData.open(os.path.join(p.artifacts_dir, "tokens"))
    store = Store.from_config(p.storage)
    rounds = Run(store, run).committed_rounds()
    if not rounds:
        raise SystemExit(f"evaluate: run {run!r} has no committed rounds on {store.url}")
    device = resolve_device(p.orchestration.device)
    per_round, node_rows = [], []
    model = None
    for r in rounds:
        model, manifest, _ = load_global(store, run, r)
        ev = heldout_loss(model.to(device), data.val, e.batch_size, e.seq_len, e.batches)
        per_round.append({"round": r, "step": manifest["meta"]["step"], "heldout_loss": ev["loss"]})
        for node, loss in manifest["meta"].get("node_loss", {}).items():
            node_rows.append({"round": r, "node": int(node), "train_loss": loss})
    torch.manual_seed(p.init.seed + UNTRAINED_SEED_OFFSET)
    untrained = heldout_loss(model.cfg.build().to(device), data.val, e.batch_size, e.seq_len, e.batches)["loss"]
    final = heldout_loss(model, data.val, e.batch_size, e.seq_len, e.batches)
    model.to("cpu")

    hf_dir = os.path.join(d, "hf")
    export_hf(model, hf_dir, os.path.join(p.artifacts_dir, "tokens", "tokenizer.json"))
    x = torch.from_numpy(data.val[: 2 * e.seq_len].astype("int64")).view(2, e.seq_len)
    with torch.no_grad():
        parity = (to_hf(model)(x).logits - model(x).logits).abs().max().item()
    metrics = {"final_round": rounds[-1], "heldout_loss": final["loss"], "heldout_perplexity": final["perplexity"],
               "untrained_heldout_loss": untrained, "initial_heldout_loss": per_round[0]["heldout_loss"],
               "hf_max_abs_logit_diff": parity, "eval_tokens": final["tokens"]}
    if e.lm_eval_tasks:
        metrics["lm_eval"] = run_lm_eval(hf_dir, list(e.lm_eval_tasks), e.lm_eval_include, e.lm_eval_limit)
    write_json(os.path.join(d, "metrics.json"), metrics)
    for name, rows in (("heldout_loss.csv", per_round), ("node_loss.csv", node_rows)):
        with open(os.path.join(d, name), "w", newline="") as f:
            if rows:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
    print(f"evaluate: {metrics}")


if __name__ == "__main__":
    main()
