"""Resume through the served deployment, as the README tells users to: a real `prefect server start`,
`python -m pipelines.serve` (deployment 'spes-training/spes'), `python -m pipelines.node_flow --nodes 0,1`
(deployments 'spes-node/spes-node-0' and '-1', the GPU-machine executor) and `prefect deployment run ...
--param resume_round=...`."""
import glob
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from pipelines.prefect_api import free_port
from spes.config.loader import load_params
from spes.run.run import Run
from spes.storage.store import Store
from tests.conftest import prefect_home
from tests.pipelines.tiny_project import assert_same, final_weights, init_run, make_project

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRAGGLER = {"slow": {"run": "dep-slow", "round": 1, "node": 1, "seconds": 30}}  # in the spes-node flow


def _api(url: str, path: str, body=None):
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def start_prefect_server(api: str, env: dict, log, procs: list) -> None:
    """`prefect server start` on `api`'s loopback port, in its own process group (appended to `procs`, which
    the caller stops), once it answers."""
    port = api.split(":")[2].split("/")[0]
    procs.append(subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                                   port, "--no-ui"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True))
    _wait_for("prefect server", lambda: _api(api, "/health") is True, 180, procs)


def _wait_for(what: str, check, timeout_s: float, procs) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: {p.args} exited with {p.returncode}")
        try:
            if check():
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.25)  # a wait ends within a quarter second of its condition; a check is one loopback request
    raise TimeoutError(f"{what} not ready after {timeout_s}s")


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_tokens, prefect_db):
    """Prefect server + served training and node deployments, all on loopback, in their own process groups."""
    root = tmp_path_factory.mktemp("deploy")
    make_project(root, tiny_tokens)
    api = f"http://127.0.0.1:{free_port()}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=prefect_home(root / "prefect_home", prefect_db), PREFECT_API_URL=api, PYTHONPATH=ROOT,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false")
    host, port = api.split("//")[1].split("/")[0].split(":")
    procs, logs = [], []

    def start(name, *args, **extra_env):
        log = open(root / f"{name}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=dict(env, **extra_env), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))

    try:
        start("server", "prefect", "server", "start", "--host", host, "--port", port, "--no-ui")
        _wait_for("prefect server", lambda: _api(api, "/health") is True, 180, procs)
        start("serve", "pipelines.serve", "--params", str(root / "params.yaml"))
        start("node", "pipelines.node_flow", "--nodes", "0,1", SPES_FAULT_PLAN=json.dumps(STRAGGLER))
        for name in ("spes-training/spes", "spes-node/spes-node-0", "spes-node/spes-node-1"):
            _wait_for(f"deployment {name}", lambda: _api(api, f"/deployments/name/{name}")["id"], 120, procs)
        yield root, env, api
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        for log in logs:
            log.close()


def deployment_run(served, *params: str) -> subprocess.CompletedProcess:
    root, env, _ = served
    args = [sys.executable, "-m", "prefect", "deployment", "run", "spes-training/spes", "--watch",
            "--watch-interval", "1", "--watch-timeout", "400"]
    for prm in params:
        args += ["--param", prm]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=450)


def _ok(res: subprocess.CompletedProcess, served) -> None:
    root = served[0]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + (root / "serve.log").read_text()[-5000:]


@pytest.mark.slow
def test_deployment_runs_and_resumes_from_any_round(served):
    root, _, api = served
    pfile = str(root / "params.yaml")
    init_run(pfile, "dep")
    _ok(deployment_run(served, "run_name=dep", "stage=warmup"), served)
    store = Store(load_params(pfile).storage.url)
    run = Run(store, "dep")
    assert run.committed_rounds() == [0, 1, 2]

    # the rest of the run, each node as a `spes-node` deployment run (the executor for GPU machines),
    # reading the token shards that the training flow published to shared storage
    cache = root / "node-cache"
    _ok(deployment_run(served, "run_name=dep", "resume_round=latest",
                       f'overrides=["orchestration.executor=deployment", "orchestration.node_cache_dir={cache}"]'),
        served)
    assert run.committed_rounds() == [0, 1, 2, 3]
    via_node_deployments = final_weights(pfile, "dep")
    (key,) = os.listdir(root / "storage/data/tokens")
    assert store.is_committed(f"data/tokens/{key}") and (cache / "tokens" / key / "COMPLETE").exists()

    # resume from round 1: rounds 2-3 are set aside and recomputed (node processes) bit for bit
    _ok(deployment_run(served, "run_name=dep", "resume_round=1"), served)
    assert run.committed_rounds() == [0, 1, 2, 3]
    assert_same(final_weights(pfile, "dep"), via_node_deployments)
    for r in ("000002", "000003"):  # the earlier rounds 2-3 are kept aside, not deleted
        assert glob.glob(str(root / f"storage/runs/dep/superseded/*/{r}"))

    runs = _api(api, "/flow_runs/filter", {"limit": 50})
    names = {(r["name"], r["state_type"]) for r in runs}
    assert {("dep-warmup", "COMPLETED"), ("dep-all-resume-latest", "COMPLETED"), ("dep-all-resume-1", "COMPLETED"),
            ("dep-node-0-round-3", "COMPLETED"), ("dep-node-1-round-3", "COMPLETED")} <= names


def test_deployment_resume_from_uncommitted_round_fails_clearly(served):
    root = served[0]
    init_run(str(root / "params.yaml"), "dep-bad")
    res = deployment_run(served, "run_name=dep-bad", "resume_round=7")
    assert res.returncode == 1 and "Failed" in res.stdout
    assert "round 7 is not committed (committed: [0])" in (root / "serve.log").read_text()
    # the same refusal said where the command was typed: the final state's message as one line
    resumed = subprocess.run([sys.executable, "-m", "pipelines.resume", "--run", "dep-bad", "--round", "7"], cwd=ROOT,
                             env=served[1], capture_output=True, text=True, timeout=300)
    last = [line for line in resumed.stderr.splitlines() if line.strip()]
    assert resumed.returncode == 1 and len(last) == 1, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert last[0].startswith("resume: OrchestrationError: flow run ") and last[0].endswith(
        "ended Failed: ProtocolError: run 'dep-bad': round 7 is not committed (committed: [0])"), last


@pytest.mark.slow
def test_straggler_node_deployment_is_cancelled_and_left_out(served):
    root, _, api = served
    pfile = str(root / "params.yaml")
    init_run(pfile, "dep-slow")
    overrides = ["orchestration.executor=deployment", "orchestration.round_timeout_s=15", "orchestration.min_nodes=1",
                 f"orchestration.node_cache_dir={root / 'node-cache'}"]
    _ok(deployment_run(served, "run_name=dep-slow", "stage=warmup", f"overrides={json.dumps(overrides)}"), served)
    store = Store(load_params(pfile).storage.url)
    meta = [store.read_manifest(f"runs/dep-slow/rounds/{r:06d}/global")["meta"] for r in (1, 2)]
    assert (meta[0]["contributors"], meta[0]["missing"]) == ([0], [1])
    assert meta[1]["contributors"] == [0, 1]  # back in the next round
    deadline = time.time() + 90
    while time.time() < deadline:  # the runner acts on the cancellation asynchronously
        states = {r["name"]: r["state_type"] for r in _api(api, "/flow_runs/filter", {"limit": 100})}
        if states.get("dep-slow-node-1-round-1") == "CANCELLED":
            break
        time.sleep(2)
    assert states.get("dep-slow-node-1-round-1") == "CANCELLED", states
    assert not store.is_committed("runs/dep-slow/rounds/000001/nodes/001")  # it never finished its round


def test_deployment_executor_names_missing_node_deployments_up_front(served):
    root = served[0]
    init_run(str(root / "params.yaml"), "dep-missing")
    overrides = ["orchestration.executor=deployment", "orchestration.node_deployment=spes-node/gone-{node}"]
    res = deployment_run(served, "run_name=dep-missing", f"overrides={json.dumps(overrides)}")
    assert res.returncode == 1
    log = (root / "serve.log").read_text()
    assert "no deployment spes-node/gone-0, spes-node/gone-1" in log and "python -m pipelines.node_flow --nodes" in log
    store = Store(load_params(str(root / "params.yaml")).storage.url)
    assert Run(store, "dep-missing").committed_rounds() == [0]  # refused before any round


def test_deployment_executor_without_an_api_url_is_refused_at_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PYTHONPATH"] = ROOT
    res = subprocess.run([sys.executable, "-m", "stages.rounds", "train", "orchestration.executor=deployment"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "PREFECT_API_URL is not set" in res.stderr and len(res.stderr.strip().splitlines()) == 1
