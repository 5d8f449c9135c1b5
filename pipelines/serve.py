"""Serve the training flow as a deployment, so a run can be resumed from the Prefect UI or CLI:

    prefect server start &                                  # UI on http://127.0.0.1:4200
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    python -m pipelines.serve &                             # deployment 'spes-training/spes'
    prefect deployment run 'spes-training/spes' --param resume_round=latest
    prefect deployment run 'spes-training/spes' --param resume_round=3
"""
from __future__ import annotations

import argparse
import os

from pipelines.training import spes_training
from spes.cli import run_command
from spes.config.loader import load_params
from spes.errors import UsageError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--name", default="spes")
    ap.add_argument("--poll-s", type=int, default=1,
                    help="seconds between the runner's queries for new runs (Prefect's default is 10: a resume would "
                         "wait up to that long to start)")
    ap.add_argument("--init", default=None,
                    help="initial model for a run not yet on storage (default: <artifacts_dir>/init/model.safetensors "
                         "if present); also checked against the run's fingerprint on resume")
    a = ap.parse_args()
    p = load_params(a.params)
    init = a.init or os.path.join(p.artifacts_dir, "init", "model.safetensors")
    params = {"params_path": os.path.abspath(a.params), "stage": "all"}
    if os.path.exists(init):
        params["init_path"] = os.path.abspath(init)
    elif a.init:
        raise UsageError(f"--init {a.init!r} does not exist")
    if a.poll_s <= 0:
        raise UsageError(f"--poll-s must be > 0, got {a.poll_s}")
    from prefect.settings import PREFECT_RUNNER_POLL_FREQUENCY, temporary_settings

    with temporary_settings({PREFECT_RUNNER_POLL_FREQUENCY: a.poll_s}):
        spes_training.serve(name=a.name, parameters=params)


if __name__ == "__main__":
    run_command(main)
