"""The whole chain through real DVC and a real Prefect server (as a monitored user runs it) on a tiny
config: tokenize -> dense -> upcycle -> warmup -> train -> evaluate; then a second `dvc repro` is a no-op,
a forced re-run of a rounds stage reports the rounds already committed on storage, and the comparison
pipeline (`dvc repro compare/dvc.yaml`) on two variants reports exactly what its runs measured."""
import csv
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from bench.cleanup import stop_process_group
from tests.conftest import prefect_home

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = {
    "model": {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 32, "num_layers": 1, "num_heads": 4,
              "num_kv_heads": 4, "num_experts": 4, "top_k": 2, "max_seq_len": 64},
    "tokenize": {"max_files": 12},
    "dense": {"steps": 20, "batch_size": 4, "seq_len": 32},
    "sync": {"every_steps": 4, "warmup_rounds": 1, "rounds": 2},
    "train": {"batch_size": 4, "seq_len": 32},
    "merge": {"interval": 4, "decay_steps": 50, "top_k": 2},
    "eval": {"batches": 2, "batch_size": 4, "seq_len": 32},
    "compare": {"variants": {"spes": [], "centralized": ["sync.method=centralized"]}, "seeds": [0]},
}


def _merge(a, b):
    for k, v in b.items():
        a[k] = _merge(a.get(k, {}), v) if isinstance(v, dict) else v
    return a


@pytest.fixture
def prefect_server_for_stages(tmp_path, prefect_db):
    """A `prefect server start` the stages report to, as in the README's monitored setup: one server for the
    test's dozen stage processes instead of a temporary one each (about 3.5 s of CPU per stage). The
    temporary server a stage starts without one is tested in tests/faults/test_stage_faults.py."""
    from pipelines.prefect_api import free_port
    from tests.pipelines.test_deployment import start_prefect_server

    api, procs = f"http://127.0.0.1:{free_port()}/api", []
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=prefect_home(tmp_path / "server-home", prefect_db), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_UI_ENABLED="false")
    try:
        start_prefect_server(api, env, subprocess.DEVNULL, procs)
        yield api
    finally:
        for proc in procs:
            stop_process_group(proc, 10)


@pytest.mark.slow
def test_dvc_repro_end_to_end(tmp_path, prefect_db, prefect_server_for_stages):
    proj = tmp_path / "proj"
    proj.mkdir()
    for d in ("spes", "stages", "pipelines", "compare"):
        shutil.copytree(os.path.join(ROOT, d), proj / d, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "dvc.yaml"), proj)
    params = _merge(yaml.safe_load(open(os.path.join(ROOT, "params.yaml"))), TINY)
    params["orchestration"]["node_cache_dir"] = str(tmp_path / "node-cache")
    params["compare"]["variants"] = TINY["compare"]["variants"]  # replaced, not merged
    params["compare"]["pairs"] = {"spes": "centralized"}  # params.yaml's names a variant the tiny matrix lacks
    (proj / "params.yaml").write_text(yaml.safe_dump(params))
    env = dict(os.environ, PYTHONPATH=str(proj), PREFECT_HOME=prefect_home(tmp_path / "prefect", prefect_db),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env["PREFECT_API_URL"] = prefect_server_for_stages
    dvc = [sys.executable, "-m", "dvc"]
    for cmd in (["git", "init", "-q"], dvc + ["init", "-q"], dvc + ["config", "core.analytics", "false"]):
        subprocess.run(cmd, cwd=proj, env=env, check=True)
    shutil.copytree(os.path.join(ROOT, ".dvc", "plots"), proj / ".dvc" / "plots")
    r = subprocess.run(dvc + ["repro"], cwd=proj, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = json.load(open(proj / "artifacts/eval/metrics.json"))
    assert m["final_round"] == 2 and m["heldout_loss"] < m["untrained_heldout_loss"]
    assert m["hf_max_abs_logit_diff"] < 1e-4
    assert json.load(open(proj / "artifacts/init/metrics.json"))["max_abs_logit_diff_vs_dense"] < 1e-4
    for stage in ("warmup", "train"):
        assert json.load(open(proj / f"artifacts/{stage}/metrics.json"))["rounds_recorded"] == 1
        assert json.load(open(proj / f"artifacts/{stage}/invocation.json"))["round_wall_s_mean"] > 0
    for stage in ("tokenize", "dense", "warmup", "train"):  # wall-clock figures are not compared as metrics
        metrics = json.load(open(proj / f"artifacts/{stage}/metrics.json"))
        assert not [k for k in metrics if "seconds" in k or k.endswith(("_s", "_s_mean", "_per_s", "overhead"))]
    lock = (proj / "dvc.lock").read_bytes()  # issue 50: a rerun leaves the lock (and so the clone) as it was
    again = subprocess.run(dvc + ["repro"], cwd=proj, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "didn't change" in again.stdout + again.stderr
    # a forced re-run finds its rounds committed: it runs none, reports the committed ones, and its out is
    # byte for byte the same (timings live in invocation.json), so nothing downstream is stale
    before = (proj / "artifacts/train/summary.json").read_bytes()
    assert json.load(open(proj / "artifacts/train/invocation.json"))["rounds_run_now"] == [2]
    forced = subprocess.run(dvc + ["repro", "-f", "-s", "train"], cwd=proj, env=env, capture_output=True,
                            text=True, timeout=300)
    assert forced.returncode == 0, forced.stdout[-3000:] + forced.stderr[-3000:]
    assert json.load(open(proj / "artifacts/train/invocation.json"))["rounds_run_now"] == []
    assert (proj / "artifacts/train/summary.json").read_bytes() == before
    # re-tokenizing the same corpus, re-training the same dense model give the same bytes (timings live in
    # invocation.json, outside the outs the later stages read), and warmup forced after train committed later
    # rounds still describes its own rounds: every stage after them stays up to date (one dvc call for the three)
    res = subprocess.run(dvc + ["repro", "-f", "-s", "tokenize", "dense", "warmup"], cwd=proj, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    status = subprocess.run(dvc + ["status", "--with-deps", "evaluate"], cwd=proj, env=env, capture_output=True, text=True, timeout=120)
    assert "up to date" in status.stdout, status.stdout
    # the forced tokenize, dense, warmup and train wrote the same metrics and outs: only invocation.json changed
    assert (proj / "dvc.lock").read_bytes() == lock
    assert json.load(open(proj / "artifacts/warmup/invocation.json"))["rounds_run_now"] == []
    warm_metrics = json.load(open(proj / "artifacts/warmup/metrics.json"))
    assert warm_metrics["last_round"] == 1 and warm_metrics["rounds_recorded"] == 1
    assert not (proj / "artifacts/compare").exists()  # the main pipeline does not run the comparison

    cmp = subprocess.run(dvc + ["repro", "compare/dvc.yaml"], cwd=proj, env=env, capture_output=True, text=True,
                         timeout=900)
    assert cmp.returncode == 0, cmp.stdout[-3000:] + cmp.stderr[-3000:]
    runs = {v: json.load(open(proj / f"artifacts/compare/runs/{v}-0-0.002-1/result.json")) for v in ("spes", "centralized")}
    rows = {r["variant"]: r for r in csv.DictReader(open(proj / "artifacts/compare/report.csv"))}
    for v, res in runs.items():
        assert float(rows[v]["heldout_loss_mean"]) == res["heldout_loss"] and rows[v]["seeds"] == "1"
        assert float(rows[v]["bytes_per_node_per_round"]) == res["bytes_per_node_per_round"] > 0
        assert int(rows[v]["tokens"]) == res["tokens"] == 2 * 4 * 32 * 4 * 2  # nodes x batch x seq x steps x rounds
    assert float(rows["spes"]["ratio_to_centralized"]) == runs["spes"]["heldout_loss"] / runs["centralized"]["heldout_loss"]
    assert int(rows["centralized"]["trainable_params_per_node"]) > int(rows["spes"]["trainable_params_per_node"])
    assert "| centralized | 4 | 1 | 0.002 |" in (proj / "artifacts/compare/report.md").read_text()
    (pair,) = csv.DictReader(open(proj / "artifacts/compare/pairs.csv"))  # one seed: no verdict on noise
    assert (pair["variant"], pair["reference"], pair["verdict"]) == ("spes", "centralized", "one seed")
    assert float(pair["diff"]) == pytest.approx(runs["spes"]["heldout_loss"] - runs["centralized"]["heldout_loss"])
    plots = subprocess.run(dvc + ["plots", "show", "--json"], cwd=proj, env=env, capture_output=True, text=True)
    assert plots.returncode == 0 and "spes (1x)" in plots.stdout and "centralized (1x)" in plots.stdout
    node_loss = json.loads(plots.stdout)["data"]["artifacts/eval/node_loss.csv"][0]["content"]
    assert node_loss["encoding"]["color"]["field"] == "node"  # one line per node, not one zig-zag
    assert {v["node"] for v in node_loss["data"]["values"]} == {"0", "1"}
    # the same plots as SVG pictures that open offline: a line per node, a line per compared variant
    import xml.etree.ElementTree as ET

    def series(svg):
        return [p.get("data-series") for p in ET.parse(proj / svg).getroot().iter("{http://www.w3.org/2000/svg}polyline")]

    assert series("artifacts/eval/node_loss.svg") == ["node 0", "node 1"]
    assert sorted(series("artifacts/compare/heldout_curves.svg")) == ["centralized (1x)", "spes (1x)"]

    # issue 33, item 5: a setting a stage refuses. `dvc exp run --temp` tries it in a copy and params.yaml
    # stays as it was; in the workspace DVC has already written it, and the one-line error says so
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["add", "-A"], cwd=proj, env=env, check=True)
    subprocess.run(git + ["commit", "-qm", "tiny"], cwd=proj, env=env, check=True)
    before = (proj / "params.yaml").read_bytes()
    for flags, hint in ((["--temp"], False), ([], True)):
        exp = subprocess.run(dvc + ["exp", "run", *flags, "-S", "sync.rounds=0"], cwd=proj, env=env,
                             capture_output=True, text=True, timeout=300)
        out = exp.stdout + exp.stderr
        assert exp.returncode != 0 and "config error: " in out and "sync.rounds must be >= 1, got 0" in out, out[-3000:]
        assert ("`git checkout params.yaml` undoes it" in out) == hint, out[-3000:]
        assert ((proj / "params.yaml").read_bytes() == before) != hint
    subprocess.run(["git", "checkout", "params.yaml"], cwd=proj, env=env, check=True)

    # issue 52: experiments queued and run two at a time (`dvc exp run --queue`, `dvc queue start -j 2`), each in
    # its own copy of the repository whose `storage.url: artifacts/storage` is the same as written, on the one
    # machine-wide node-state folder: the workspace run's node state is left exactly as it was (before, every
    # copy's first round deleted it: the key was the URL as written, and the copy's storage has another run)
    state = tmp_path / "node-cache" / "state"

    def tree(folder):
        return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
                for d, _, files in os.walk(folder) for f in files}

    (workspace,) = os.listdir(state)  # the workspace storage's folder
    held = tree(state / workspace)
    assert held
    with open(proj / ".gitignore", "a") as f:
        f.write("/artifacts/storage/\n/artifacts/tensorboard/\n")
    subprocess.run(["git", "rm", "-r", "-q", "--cached", "artifacts/storage", "artifacts/tensorboard"], cwd=proj, env=env,
                   check=True)  # committed above with the rest; a real checkout ignores them (.gitignore)
    subprocess.run(git + ["add", "-A"], cwd=proj, env=env, check=True)
    subprocess.run(git + ["commit", "-qm", "ignore storage"], cwd=proj, env=env, check=True)
    for steps in (3, 5):
        q = subprocess.run(dvc + ["exp", "run", "--queue", "-S", f"sync.every_steps={steps}"], cwd=proj, env=env,
                           capture_output=True, text=True, timeout=120)
        assert q.returncode == 0, q.stdout + q.stderr
    # the workers are forked from `dvc queue start` and inherit its stdout: a pipe would stay open (and `run` wait)
    # until they finish the queue, so their output goes to a file
    with open(tmp_path / "queue-start.log", "wb") as log:
        subprocess.run(dvc + ["queue", "start", "-j", "2"], cwd=proj, env=env, check=True, stdout=log, stderr=log,
                       stdin=subprocess.DEVNULL, timeout=120)
    deadline = time.time() + 900
    while True:
        status = subprocess.run(dvc + ["queue", "status"], cwd=proj, env=env, capture_output=True, text=True,
                                timeout=120).stdout
        if "Queued" not in status and "Running" not in status:
            break
        assert time.time() < deadline, status
        time.sleep(5)
    assert status.count("Success") == 2, status + (tmp_path / "queue-start.log").read_text(errors="replace")[-3000:]
    assert tree(state / workspace) == held  # not one byte of the workspace run's node state touched
    assert len(os.listdir(state)) == 3  # one folder per storage location: the workspace and the two copies
