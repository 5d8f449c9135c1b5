"""Faults driven end to end through the DVC entry points (`python -m stages.<stage>`) on a tiny project:
each case ends with the run bitwise equal to an uninterrupted one, or with a one-line error and nothing on
storage changed."""
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from spes.config.loader import load_params
from spes.model.transformer import CausalLM
from spes.run.layout import MODEL_FILE
from spes.run.run import Run
from spes.storage.store import Store
from tests.conftest import prefect_home
from tests.pipelines.tiny_project import INIT_SEED, make_project

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_tokens, prefect_db):
    root = tmp_path_factory.mktemp("faults")
    make_project(root, tiny_tokens)
    prefect_home(root / "prefect_home", prefect_db)  # the stages' Prefect database, migrated already
    p = load_params(str(root / "params.yaml"))
    torch.manual_seed(INIT_SEED)
    model = CausalLM(p.model)
    (root / "artifacts/init").mkdir()
    save_file(model.canonical_state_dict(), str(root / "artifacts/init/model.safetensors"))
    (root / "artifacts/init/config.json").write_text(json.dumps({"model_config": dataclasses.asdict(p.model), "source": "test"}))
    return root


def stage(project, *args, env_extra=None, wait=True, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PYTHONPATH=ROOT, PREFECT_HOME=str(project / "prefect_home"), **(env_extra or {}))
    cmd = [sys.executable, "-m", *args, "--params", str(project / "params.yaml")]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def global_sha(project, run, r):
    store = Store(str(project / "storage"))
    return store.read_manifest(Run(store, run).layout.global_dir(r))["files"][MODEL_FILE]["sha256"]


@pytest.fixture(scope="module")
def reference(tiny_reference):
    """Global 2 of the tiny project's uninterrupted run (one reference run per session: tests/conftest.py),
    what the warmup stage (2 rounds) must commit however it is interrupted."""
    return tiny_reference["sha"][2]


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_sigkilled_stage_leaves_no_processes_and_a_rerun_continues_at_once(project, reference):
    proc = stage(project, "stages.rounds", "warmup", "orchestration.run_name=killed", wait=False)
    store = Store(str(project / "storage"))
    layout = Run(store, "killed").layout
    deadline = time.time() + 300
    while not store.is_committed(layout.global_dir(1)):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:] if proc.stdout else ""
        time.sleep(0.5)
    helpers = _descendants(proc.pid)  # the Prefect server and the node processes
    assert len(helpers) >= 3
    proc.kill()
    proc.wait()
    deadline = time.time() + 20
    while any(_alive(h) for h in helpers) and time.time() < deadline:
        time.sleep(0.2)
    assert not [h for h in helpers if _alive(h)], "processes outlived the killed stage"
    t0 = time.time()
    res = stage(project, "stages.rounds", "warmup", "orchestration.run_name=killed")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert time.time() - t0 < 300  # the dead writer's lease (ttl 600 s) did not have to expire
    assert global_sha(project, "killed", 2) == reference


@pytest.mark.slow
def test_a_corrupt_committed_upload_is_rerun_and_the_result_unchanged(project, reference):
    plan = json.dumps({"corrupt": {"run": "corrupt", "round": 2, "node": 0}})
    res = stage(project, "stages.rounds", "warmup", "orchestration.run_name=corrupt", env_extra={"SPES_FAULT_PLAN": plan})
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "nodes/000/shared.safetensors" in out and "re-running nodes [0]" in out
    assert "node 1 | node 1 round 2: step 3/3, loss " in out  # node progress relayed to the node task's log
    assert "View at http" not in out  # no link to the temporary server (it has no UI and dies with the stage)
    assert global_sha(project, "corrupt", 2) == reference
    assert os.listdir(project / "storage/runs/corrupt/rejected")[0].startswith("000002-000-")


def _tree_digest(folder) -> str:
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(folder)):
        for f in sorted(files):
            h.update(f"{os.path.relpath(os.path.join(dirpath, f), folder)}\n".encode())
            h.update(open(os.path.join(dirpath, f), "rb").read())
    return h.hexdigest()


@pytest.mark.parametrize("override,message", [
    ("train.optim.lr=-1", "train.optim.lr must be > 0"),
    ("dense.batch_size=0", "dense.batch_size must be >= 1"),
    ("sync.ownership=[[0,1,2,3]]", "sync.ownership: ownership lists 1 nodes but sync.num_nodes is 2"),
    ("model.num_kv_heads=0", "model.num_kv_heads must be > 0"),
    ("orchestration.lock_ttl_s=0", "orchestration.lock_ttl_s must be >= 3"),
    ("orchestration.run_name=../../../x", "orchestration.run_name: '../../../x' is not a safe name"),
    ("orchestration.tensorboard_dir=/etc/passwd", "orchestration.tensorboard_dir: /etc/passwd is a file"),
    ("orchestration.tensorboard_dir=/proc/x", "orchestration.tensorboard_dir: /proc/x cannot be written"),
    ("orchestration.node_state_dir=/etc/passwd/state", "orchestration.node_state_dir: /etc/passwd/state cannot "
                                                         "be made: /etc/passwd is a file"),
    ("sync.every_steps=abc", "command line 'sync.every_steps=abc': Value 'abc'"),
    # fit params.yaml's model but not the initial model the run trains (4 experts): refused before round 0
    ("model.num_experts=8 merge.top_k=5", "the settings do not fit the model this run trains"),
])
def test_bad_settings_fail_before_anything_runs_or_is_written(project, reference, override, message):
    before = _tree_digest(project / "storage")
    res = stage(project, "stages.rounds", "warmup", "orchestration.run_name=refused", *override.split(), timeout=120)
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines, res.stdout[-3000:]
    assert lines == [f"config error: {lines[0].split('config error: ')[1]}"] and message in lines[0]
    assert _tree_digest(project / "storage") == before


def test_model_vocab_smaller_than_the_token_ids_fails_before_compute(project):
    res = stage(project, "stages.dense", "model.vocab_size=100", timeout=120)
    assert res.returncode != 0
    assert "model.vocab_size (100) is smaller than the tokenizer's vocabulary (512)" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_failed_tokenize_leaves_the_token_folder_as_it_was(project):
    before = _tree_digest(project / "artifacts/tokens")
    res = stage(project, "stages.tokenize", "tokenize.max_files=5", "model.vocab_size=64", timeout=300)
    assert res.returncode != 0 and "tokenize:" in res.stderr and "Traceback" not in res.stderr
    assert _tree_digest(project / "artifacts/tokens") == before
    assert not [p for p in os.listdir(project / "artifacts") if p.startswith(".tokens")]


def test_a_deterministic_node_error_is_not_retried_and_names_its_cause(project):
    """Issue 18, item 3: a non-finite loss cannot change on a retry: the node runs once, and the stage's last
    line says which node failed and why, not only that the quorum was missed."""
    res = stage(project, "stages.rounds", "warmup", "orchestration.run_name=nan", "train.optim.lr=1e6",
                "train.optim.grad_clip=0", "train.optim.warmup_steps=0", "sync.every_steps=6", timeout=300)
    assert res.returncode == 1
    last = [line for line in res.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("rounds: QuorumError: round 1: only nodes [] committed") and "NonFiniteLoss" in last, last
    out = res.stdout + res.stderr
    assert "Retry 1/" not in out and out.count("failed round 1") == 2  # each node once, no retries


@pytest.mark.slow
def test_sigterm_stops_the_stage_within_seconds_releasing_the_lease(project, reference):
    """SIGTERM while a node is in the middle of a round: the stage ends within seconds (not at the round
    timeout), its node processes and Prefect server with it, the run's lease is marked released, and the
    same command resumes the run to the uninterrupted result."""
    import signal

    plan = json.dumps({"slow": {"run": "termed", "round": 1, "node": 1, "seconds": 300}})
    proc = stage(project, "stages.rounds", "warmup", "orchestration.run_name=termed", env_extra={"SPES_FAULT_PLAN": plan},
                 wait=False)
    store = Store(str(project / "storage"))
    layout = Run(store, "termed").layout
    deadline = time.time() + 300
    while not store.is_committed(layout.node_dir(1, 0)):  # node 0 is done, node 1 is in its slow step
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    time.sleep(1)
    helpers = _descendants(proc.pid)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert time.time() - t0 < 30 and proc.returncode == 130, out[-3000:]
    assert "stopped by SIGTERM" in out and "resume with the same command" in out
    deadline = time.time() + 20
    while any(_alive(h) for h in helpers) and time.time() < deadline:
        time.sleep(0.2)
    assert not [h for h in helpers if _alive(h)], "processes outlived the stopped stage"
    leases = sorted(store.list_names(layout.lease_dir))
    assert json.loads(store.read_bytes(f"{layout.lease_dir}/{leases[-1]}"))["released"] is True
    assert not store.is_committed(layout.global_dir(1))
    res = stage(project, "stages.rounds", "warmup", "orchestration.run_name=termed")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert global_sha(project, "termed", 2) == reference


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_stage_stopped_mid_round_on_s3_resumes_with_the_same_command(project, reference, monkeypatch, how):
    """Storage on an S3 server: the stage stopped while node 1 is in the middle of round 1 (node 0's upload
    committed). The same command moves the partial round aside (object by object: S3 has no folders to mv)
    and ends bitwise equal to the uninterrupted run; the partial round is kept under superseded/, whole."""
    import signal

    from tests.faults.test_storage_faults import _moto_server

    with _moto_server(monkeypatch) as (endpoint, _):
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("stops")
        on_s3 = ["storage.url=s3://stops/spes", f"storage.options.endpoint_url={endpoint}",
                 f"orchestration.run_name=s3-{how.lower()}"]
        plan = json.dumps({"slow": {"run": f"s3-{how.lower()}", "round": 1, "node": 1, "seconds": 300}})
        proc = stage(project, "stages.rounds", "warmup", *on_s3, env_extra={"SPES_FAULT_PLAN": plan}, wait=False)
        store = Store("s3://stops/spes", {"endpoint_url": endpoint})
        layout = Run(store, f"s3-{how.lower()}").layout
        deadline = time.time() + 300
        while not store.is_committed(layout.node_dir(1, 0)):
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.5)
        proc.send_signal(getattr(signal, how))
        proc.communicate(timeout=120)
        time.sleep(1)  # a killed stage's helpers go with it (test_sigkilled_stage_...)
        res = stage(project, "stages.rounds", "warmup", *on_s3)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert store.read_manifest(layout.global_dir(2))["files"][MODEL_FILE]["sha256"] == reference
        stamps = store.list_names(f"{layout.base}/superseded")
        assert len(stamps) == 1 and store.is_committed(f"{layout.base}/superseded/{stamps[0]}/000001/nodes/000")
