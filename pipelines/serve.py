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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--name", default="spes")
    a = ap.parse_args()
    spes_training.serve(name=a.name, parameters={"params_path": os.path.abspath(a.params), "stage": "all"})


if __name__ == "__main__":
    main()
