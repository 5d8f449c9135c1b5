"""DVC stages `warmup` and `train`: run SPES rounds through the Prefect flow.

    python -m stages.rounds warmup     rounds 1..sync.warmup_rounds (expert merging on)
    python -m stages.rounds train      the remaining rounds, from warmup's last committed round

Reads artifacts/init (the upcycle stage's model) and artifacts/tokens; writes the rounds on shared storage
(storage.url) and artifacts/<stage>/summary.json (what was computed), metrics.json (the round counts) and
invocation.json (what this invocation took: wall clock, rounds run now, traffic and storage byte counts).
Example: python -m stages.rounds train sync.rounds=12
"""
from __future__ import annotations

import os

from spes.errors import MissingInput
from stages.common import out_dir, prefect_env_defaults, run, write_json, write_metrics


def main() -> None:
    from stages.common import parse

    a, p = parse(__doc__, stages=("warmup", "train"))
    stage = a.stage
    from pipelines.executors import executor_for

    executor = executor_for(p)
    executor.preflight(p)
    init = os.path.join(p.artifacts_dir, "init", "model.safetensors")
    if not os.path.exists(init):  # say so at once, not after the Prefect server and the nodes started
        raise MissingInput(f"{init} does not exist: run the earlier stages first (dvc repro upcycle)")
    from spes.config.schema import check_against_model
    from spes.run.identity import InitModel

    check_against_model(p, InitModel.config_of(init)["model_config"], init)  # the flow checks again; here, one line
    prefect_env_defaults()
    from pipelines.prefect_api import prefect_api
    from spes.round.context import RoundContext

    # node processes start while the Prefect server does (the flow's own start is then a no-op)
    executor.start(RoundContext.build(p, p.orchestration.run_name))
    with prefect_api():  # PREFECT_API_URL, or a local server that dies with this process
        # prefect is imported only now: its settings are read at import, after PREFECT_API_URL is set
        from pipelines.stopping import stop_on_signals
        from pipelines.training import spes_training

        stop_on_signals()
        out = spes_training(params_path=a.params, overrides=a.overrides, stage=stage,
                            run_name=p.orchestration.run_name,
                            init_path=os.path.join(p.artifacts_dir, "init", "model.safetensors"),
                            on_mismatch="error")
    _write_outputs(p, stage, out)


def _write_outputs(p, stage: str, out: dict) -> None:
    """summary.json, metrics.json and invocation.json of the stage: its rounds as committed on storage, whether
    run now or by an earlier (resumed) invocation."""
    from spes.run.layout import MODEL_FILE
    from spes.run.run import Run

    first, last = (1, p.sync.warmup_rounds) if stage == "warmup" else (p.sync.warmup_rounds + 1, p.sync.rounds)
    run = Run.open(p.storage, out["run"])
    rounds = run.records(first, last)
    stage_last = min(out["latest_committed"], last)
    # summary.json is a DVC out: only what the rounds computed (bit for bit the same on a rerun), no timings
    summary = {"run": out["run"], "last_round": stage_last,
               "global_sha256": run.store.read_manifest(run.layout.global_dir(stage_last))["files"][MODEL_FILE]["sha256"],
               "rounds": [{"round": rec.round, "contributors": rec.aggregate.contributors,
                           "train_loss": {n.node: n.upload.loss_mean for n in rec.nodes if n.ok},
                           "heldout_loss": rec.heldout_loss} for rec in rounds]}
    walls = [rec.wall_s for rec in rounds]
    computes = [rec.max_node_compute_s for rec in rounds]
    node_rows = [n for rec in rounds for n in rec.nodes if n.ok]

    def mean(values):
        values = list(values)
        return sum(values) / len(values) if values else 0.0

    # metrics.json: what the rounds computed (the same on every rerun); invocation.json: wall clock and the byte
    # counts, which include manifests, checkpoint metas and heartbeats that carry wall times (their length varies
    # by a few bytes). A rerun after later rounds exist still describes this stage's rounds (storage_bytes: the
    # run now)
    metrics = {"last_round": stage_last, "rounds_recorded": len(rounds), "rounds_run_now": out["rounds_run"],
               "round_wall_s_mean": mean(walls), "heldout_s_mean": mean(rec.heldout_s for rec in rounds),
               "orchestration_overhead": (1 - sum(computes) / sum(walls)) if walls else 0.0,
               "bytes_up_per_node_round": mean(n.bytes_up for n in node_rows),
               "bytes_down_per_node_round": mean(n.bytes_down for n in node_rows),
               "storage_bytes": run.store.size_of(run.layout.base)}
    d = out_dir(p, stage)
    write_json(os.path.join(d, "summary.json"), summary)
    write_metrics(d, metrics)
    print(f"{stage}: {metrics}")


if __name__ == "__main__":
    run(main)
