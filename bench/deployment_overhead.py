"""The deployment executor's cost per round against the process executor's, side by side in one run.

Starts a Prefect server and a node machine (`python -m pipelines.node_flow --nodes 0,1`, its own HOME) on
loopback, then runs the same run (the embedded default's model and round size) once per executor, `--repeat`
times alternating, and compares the rounds' wall times from their records on storage (the first round of
each run excluded: it pays the processes' start). Goal: deployment wall per round <= 2x the process
executor's, over all repeats (each repeat's ratio printed too: on one 2-core machine the Prefect server's
SQLite writes wait now and then for its event persister, which competes with the training for the cores).

    python bench/deployment_overhead.py [--rounds 6] [--repeat 3] [--json]
        [--database-url postgresql+asyncpg://user@127.0.0.1:5432/prefect]   # the server on PostgreSQL, not SQLite
"""
from __future__ import annotations

import argparse
import atexit
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.cleanup import exit_on_termination, stop_process_group  # noqa: E402
from pipelines.prefect_api import free_port  # noqa: E402

PARAMS = {  # params.yaml's embedded default model and round (50 steps of 8 x 128 tokens), a 512-token vocabulary
    "model": {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 4, "num_experts": 8, "top_k": 2, "max_seq_len": 256},
    "sync": {"num_nodes": 2, "every_steps": 50, "warmup_rounds": 1}, "train": {"batch_size": 8, "seq_len": 128},
    "orchestration": {"round_timeout_s": 300},
    "checkpoint": {"every_rounds": 100},
    "dense": {"seq_len": 128}, "eval": {"seq_len": 128, "batches": 2, "batch_size": 2, "every_rounds": 0},
}


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _wait(what: str, check, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"deployment_overhead: {what} not ready after {timeout_s:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--database-url", default=None,
                    help="the Prefect server's database (default: its own SQLite file), e.g. an empty PostgreSQL one")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    import torch
    import yaml

    from spes.config.loader import load_params
    from spes.data.tokenization import tokenize_corpus
    from spes.model.transformer import CausalLM
    from spes.run.identity import InitModel, settings_fingerprint
    from spes.run.run import Run
    from spes.storage.store import Store

    exit_on_termination()  # a kill still runs the cleanup below
    tmp = tempfile.mkdtemp(prefix="spes-overhead-")
    atexit.register(shutil.rmtree, tmp, True)  # after the finally below has stopped the server and the nodes
    docs = [open(f, encoding="utf-8").read()
            for f in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))]
    tokenize_corpus(docs, os.path.join(tmp, "artifacts", "tokens"), 512, None, 0.2, 0)
    p = json.loads(json.dumps(PARAMS))
    p["sync"]["rounds"] = a.rounds
    p.update(artifacts_dir=os.path.join(tmp, "artifacts"), storage={"url": os.path.join(tmp, "storage")})
    pfile = os.path.join(tmp, "params.yaml")
    with open(pfile, "w") as f:
        yaml.safe_dump(p, f)
    params = load_params(pfile)
    store = Store.from_config(params.storage)
    pairs = [(f"{executor}-{k}", executor) for k in range(a.repeat) for executor in ("process", "deployment")]
    for run, _ in pairs:
        torch.manual_seed(0)
        Run(store, run).ensure(settings_fingerprint(params),
                               InitModel.from_state(CausalLM(params.model).canonical_state_dict(), params.model, "bench"))

    api = f"http://127.0.0.1:{free_port()}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PYTHONPATH=ROOT, PREFECT_API_URL=api, PREFECT_HOME=os.path.join(tmp, "prefect"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false")
    port = api.split(":")[2].split("/")[0]
    server_env = dict(env, **({"PREFECT_SERVER_DATABASE_CONNECTION_URL": a.database_url} if a.database_url else {}))
    procs = [subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               port, "--no-ui"], env=server_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)]
    try:
        _wait("the Prefect server", lambda: _get(api + "/health") is True, 180)
        node_home = os.path.join(tmp, "node-machine")
        os.makedirs(node_home)
        procs.append(subprocess.Popen([sys.executable, "-m", "pipelines.node_flow", "--nodes", "0,1"], cwd=node_home,
                                      env=dict(env, HOME=node_home), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
        _wait("the node deployments", lambda: all(
            _get(f"{api}/deployments/name/spes-node/spes-node-{i}").get("status") == "READY" for i in (0, 1)), 120)
        walls = {}
        for run, executor in pairs:
            code = ("import sys; from pipelines.training import spes_training; spes_training(params_path=sys.argv[1], "
                    "stage='all', run_name=sys.argv[2], overrides=[f'orchestration.executor={sys.argv[3]}'])")
            t = time.time()
            out = subprocess.run([sys.executable, "-c", code, pfile, run, executor], env=env, capture_output=True,
                                 text=True)
            if out.returncode:
                raise SystemExit(f"deployment_overhead: the {run} run failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
            recs = Run(store, run).records(2, a.rounds)
            walls[run] = {"round_wall_s": [rec.wall_s for rec in recs], "flow_s": time.time() - t,
                          "max_node_compute_s": [rec.max_node_compute_s for rec in recs]}
        # where a deployment round's time goes: each node flow run's creation, start and end
        runs = json.loads(urllib.request.urlopen(urllib.request.Request(
            api + "/flow_runs/filter", data=json.dumps({"limit": 200}).encode(),
            headers={"Content-Type": "application/json"}), timeout=10).read())
        from datetime import datetime

        def t(x):
            return datetime.fromisoformat(x.replace("Z", "+00:00")).timestamp() if x else None

        lags = [(t(r["start_time"]) - t(r["created"]), t(r["end_time"]) - t(r["start_time"]))
                for r in runs if r["name"].startswith("deployment-node-") and r["start_time"] and r["end_time"]]
        if lags:
            walls["node_flow_runs"] = {"created_to_start_s": sum(x for x, _ in lags) / len(lags),
                                       "start_to_end_s": sum(y for _, y in lags) / len(lags)}
    finally:
        for proc in reversed(procs):
            stop_process_group(proc, 15)

    def mean(xs):
        return sum(xs) / len(xs)

    def per_round(executor, key="round_wall_s"):
        return mean([x for run, ex in pairs if ex == executor for x in walls[run][key]])

    print(f"rounds 2..{a.rounds} of {a.repeat} runs per executor, {PARAMS['sync']['every_steps']} steps each, "
          f"2 nodes on this machine, Prefect server on {'PostgreSQL' if a.database_url else 'SQLite'}")
    for k in range(a.repeat):
        p_w, d_w = mean(walls[f"process-{k}"]["round_wall_s"]), mean(walls[f"deployment-{k}"]["round_wall_s"])
        print(f"  repeat {k}: process {p_w:5.2f} s, deployment {d_w:5.2f} s per round = {d_w / p_w:.2f}x")
    proc_w, dep_w = per_round("process"), per_round("deployment")
    print(f"process executor    {proc_w:6.2f} s per round (node compute {per_round('process', 'max_node_compute_s'):.2f} s)")
    print(f"deployment executor {dep_w:6.2f} s per round (node compute "
          f"{per_round('deployment', 'max_node_compute_s'):.2f} s)")
    print(f"deployment / process = {dep_w / proc_w:.2f}x (goal <= 2x); overhead beyond the process executor "
          f"{dep_w - proc_w:.2f} s per round")
    if "node_flow_runs" in walls:
        print(f"node flow runs: created -> running {walls['node_flow_runs']['created_to_start_s']:.2f} s, running -> "
              f"finished {walls['node_flow_runs']['start_to_end_s']:.2f} s (mean)")
    if a.json:
        print(json.dumps({"process_round_s": proc_w, "deployment_round_s": dep_w, "ratio": dep_w / proc_w,
                          "walls": walls}))


if __name__ == "__main__":
    main()
