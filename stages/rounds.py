"""DVC stages `warmup` and `train`: run SPES rounds through the Prefect flow.

    python -m stages.rounds warmup     rounds 1..spes.warmup_rounds (expert merging on)
    python -m stages.rounds train      the remaining rounds, from warmup's last committed round
"""
from __future__ import annotations

import os
import sys

from stages.common import out_dir, prefect_env_defaults, run, write_json


def main() -> None:
    stage = sys.argv.pop(1) if len(sys.argv) > 1 and sys.argv[1] in ("warmup", "train") else None
    if stage is None:
        raise SystemExit("usage: python -m stages.rounds warmup|train [--params P] [key=value ...]")
    from stages.common import parse

    a, p = parse(__doc__)
    prefect_env_defaults()
    from pipelines.node_pool import POOL
    from pipelines.prefect_api import prefect_api

    if p.orchestration.executor == "process":
        POOL.start(range(p.spes.nodes))  # node processes start while the Prefect server does
    with prefect_api():  # PREFECT_API_URL, or a local server that dies with this process
        from pipelines.training import spes_training
        from spes.run.run import Run
        from spes.storage.store import Store

        out = spes_training(params_path=a.params, overrides=a.overrides, stage=stage,
                            run_name=p.orchestration.run_name,
                            init_path=os.path.join(p.artifacts_dir, "init", "model.safetensors"),
                            on_mismatch="restart" if stage == "warmup" else "error")
    # the stage's rounds as committed on storage, whether run now or by an earlier (resumed) invocation
    first, last = (1, p.spes.warmup_rounds) if stage == "warmup" else (p.spes.warmup_rounds + 1, p.spes.rounds)
    run = Run(Store.from_config(p.storage), out["run"])
    rounds = run.records(first, last)
    summary = {"run": out["run"], "latest_committed": out["latest_committed"], "rounds": rounds,
               "rounds_run_now": [r["round"] for r in out["rounds"]]}
    walls = [r["wall_s"] for r in rounds]
    computes = [r["max_node_compute_s"] for r in rounds]
    node_rows = [n for r in rounds for n in r["nodes"] if n.get("status") == "ok"]

    def mean(key):
        return sum(n.get(key, 0) for n in node_rows) / len(node_rows) if node_rows else 0.0

    # a rerun after later rounds exist still describes this stage's rounds (storage_bytes: the run now)
    metrics = {"last_round": min(out["latest_committed"], last), "rounds_recorded": len(rounds),
               "round_wall_s_mean": sum(walls) / len(walls) if walls else 0.0,
               "orchestration_overhead": (1 - sum(computes) / sum(walls)) if walls else 0.0,
               "bytes_up_per_node_round": mean("bytes_up"), "bytes_down_per_node_round": mean("bytes_down"),
               "storage_bytes": run.store.size_of(run.layout.base)}
    d = out_dir(p, stage)
    write_json(os.path.join(d, "summary.json"), summary)
    write_json(os.path.join(d, "metrics.json"), metrics)
    print(f"{stage}: {metrics}")


if __name__ == "__main__":
    run(main)
