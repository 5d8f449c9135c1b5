"""A run to watch, in one command: a Prefect server with its UI and TensorBoard on loopback, and a short fresh
run of its own name; the two URLs are printed before the first round starts.

    python -m pipelines.watch                                 # 4 rounds (2 of warm-up), run watch-<time>
    python -m pipelines.watch --rounds 10 train.optim.lr=0.004
    python -m pipelines.watch --exit                          # stop the servers when the run ends

The run is params.yaml's recipe (with the overrides) under its own name, on params.yaml's storage beside
the pipeline's run, from the pipeline's tokens and initial model (`dvc repro upcycle` makes them; this
says so when they are missing). Its TensorBoard events go to the run's folder under
orchestration.tensorboard_dir; DVC's outputs are left alone. With PREFECT_API_URL set, that server is used
and no other is started. The servers stay up after the run until Ctrl-C (or end with it: --exit); they end
with this command however it ends.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from pipelines.node_pool import spawn
from pipelines.prefect_api import check_api_access, drain_prefect_workers, free_port, wait_for_http
from spes.cli import run_command
from spes.errors import MissingInput, UsageError


def _settings(a) -> list[str]:
    if a.rounds < 1:
        raise UsageError(f"--rounds must be >= 1, got {a.rounds}")
    name = a.name or time.strftime("watch-%Y%m%d-%H%M%S")
    return [*a.overrides, f"orchestration.run_name={name}", f"sync.rounds={a.rounds}",
            f"sync.warmup_rounds={a.rounds // 2}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of the run, half of them warm-up (default 4)")
    ap.add_argument("--name", default=None, help="the run's name (default watch-<date>-<time>)")
    ap.add_argument("--exit", action="store_true", help="stop the servers when the run ends")
    ap.add_argument("overrides", nargs="*", help="key=value settings over params.yaml's")
    a = ap.parse_args()
    overrides = _settings(a)
    p, init = _checked(a.params, overrides)  # every setting checked before a server starts
    from spes.run.board import board_dir

    run = p.orchestration.run_name
    procs: list[subprocess.Popen] = []
    try:
        ui, api = _prefect_server(procs)
        tb_url = _tensorboard(board_dir(p, run), procs)
        print(f"watch: run {run}, {a.rounds} rounds of {p.sync.every_steps} local steps on {p.sync.num_nodes} nodes", flush=True)
        print(f"watch: Prefect UI  {ui}", flush=True)
        print(f"watch: TensorBoard {tb_url or 'off (orchestration.tensorboard_dir is null)'}", flush=True)
        os.environ["PREFECT_API_URL"] = api
        from pipelines.stopping import stop_on_signals
        from pipelines.training import spes_training

        stop_on_signals()
        out = spes_training(params_path=a.params, overrides=overrides, stage="all", run_name=run, init_path=init)
        print(f"watch: run {run}: rounds {out['first_round']}-{out['last_round']} committed", flush=True)
        if not a.exit:
            print("watch: the servers stay up; Ctrl-C stops them", flush=True)
            while all(proc.poll() is None for proc in procs):
                time.sleep(1)
    finally:  # each server in its own process group: the Prefect server's own children end with it
        drain_prefect_workers()  # the last logs and events sent while the server still listens (else exit waits)
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()


def _checked(params: str, overrides: list[str]):
    """The settings and the initial model's path, each checked (one line) before anything starts."""
    from pipelines.executors import executor_for
    from spes.config.loader import load_params
    from spes.config.local_paths import check_local_paths
    from spes.config.schema import check_against_model
    from spes.run.identity import InitModel

    p = load_params(params, overrides)
    init = os.path.join(p.artifacts_dir, "init", "model.safetensors")
    if not os.path.exists(init):
        raise MissingInput(f"{init} does not exist: make the tokens and the initial model first (dvc repro upcycle)")
    check_against_model(p, InitModel.config_of(init)["model_config"], init)
    check_local_paths(p, executor_for(p).nodes_here)
    return p, init


def _prefect_server(procs: list) -> tuple[str, str]:
    """(UI URL, API URL): PREFECT_API_URL's server when set, else one started here on loopback, answering."""
    api = os.environ.get("PREFECT_API_URL")
    if api:
        check_api_access(api)
        return os.environ.get("PREFECT_UI_URL") or api.removesuffix("/api"), api
    port = free_port()
    ui, api = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_API_URL=api,
               PREFECT_SERVER_UI_API_URL=api)
    proc = spawn([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    procs.append(proc)
    wait_for_http(f"{api}/health", proc, "the Prefect server")
    return ui, api


def _tensorboard(folder: Optional[str], procs: list) -> Optional[str]:
    """TensorBoard on loopback over the run's events folder, answering; None when the run writes none."""
    if folder is None:
        return None
    port = free_port()
    os.makedirs(folder, exist_ok=True)
    proc = spawn([sys.executable, "-m", "tensorboard.main", "--logdir", folder, "--host", "127.0.0.1", "--port",
                  str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    procs.append(proc)
    wait_for_http(f"http://127.0.0.1:{port}/", proc, "TensorBoard")
    return f"http://127.0.0.1:{port}"


def _signal_group(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    run_command(main)
