"""Shared bits of the DVC entry points: argument parsing, params, output folders, Prefect env defaults."""
from __future__ import annotations

import argparse
import os

from spes.cli import run_command
from spes.config.loader import load_params
from spes.config.local_paths import check_local_paths
from spes.config.schema import Params
from spes.storage.atomic import write_json  # noqa: F401  (the stages write their JSON through it)


def parse(description: str, stages: tuple[str, ...] = ()) -> tuple[argparse.Namespace, Params]:
    """The stage's arguments (`--help` prints its docstring: what it does, reads and writes) and its params."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if stages:
        ap.add_argument("stage", choices=stages)
    ap.add_argument("--params", default="params.yaml", help="the params file (default: params.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the params file, e.g. sync.rounds=12")
    a = ap.parse_intermixed_args()  # overrides anywhere on the line, as OmegaConf/Hydra users expect
    p = load_params(a.params, a.overrides)  # a ConfigError ends the stage in one line (run)
    from pipelines.executors import executor_for

    check_local_paths(p, executor_for(p).nodes_here)  # before anything is written
    return a, p


VARYING_KEYS = ("seconds", "encode_seconds", "tokens_per_s", "round_wall_s_mean", "heldout_s_mean",
                "orchestration_overhead", "rounds_run_now", "bytes_up_per_node_round", "bytes_down_per_node_round",
                "storage_bytes")
"""What one invocation of a stage took, which changes from run to run and machine to machine: wall clock, the
rounds it ran itself (a resumed or forced one runs fewer), and byte counts that include manifests, records
and heartbeats (they carry wall times, whose digits vary). They go to invocation.json, neither a DVC output nor in git, so a
rerun leaves the clone clean; metrics.json holds what the run computed, compared by `dvc metrics diff` and
`dvc exp show`."""


def write_metrics(folder: str, values: dict) -> None:
    """A stage's numbers: metrics.json (compared across experiments) and invocation.json (what this invocation took)."""
    write_json(os.path.join(folder, "metrics.json"), {k: v for k, v in values.items() if k not in VARYING_KEYS})
    write_json(os.path.join(folder, "invocation.json"), {k: v for k, v in values.items() if k in VARYING_KEYS})


def out_dir(p: Params, name: str) -> str:
    d = os.path.join(p.artifacts_dir, name)
    os.makedirs(d, exist_ok=True)
    return d


def prefect_env_defaults() -> None:
    """Quiet, local Prefect defaults for the stages (no analytics; INFO logs)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    # the library's warnings (a superseded run, a retried storage call, retention) reach the Prefect UI too
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "spes")


def experiment_hint() -> str:
    """In `dvc exp run` in the workspace, DVC writes `-S` values into params.yaml before any stage runs and
    leaves them there when a stage refuses them: the next plain `dvc repro` would use them. Say so."""
    if not os.environ.get("DVC_EXP_NAME") or f"{os.sep}.dvc{os.sep}tmp{os.sep}" in os.getcwd() + os.sep:
        return ""  # not an experiment, or a --temp/--queue one in its own copy of the repository
    return ("; `dvc exp run -S` has written the refused value into params.yaml: `git diff params.yaml` shows it, "
            "`git checkout params.yaml` undoes it (`dvc exp run --temp -S ...` tries settings in a copy)")


def run(main) -> None:
    """Run a stage's main: any SpesError (bad settings, a damaged file, storage, the round protocol) ends the
    stage with one line on stderr naming the problem (exit 2 for settings, 1 otherwise), not a traceback; a
    settings error in a workspace `dvc exp run` says what DVC did to params.yaml."""
    run_command(main, hint=experiment_hint, interrupted="committed rounds are kept, resume with the same command")
