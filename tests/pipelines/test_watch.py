"""`python -m pipelines.watch`: a Prefect server with its UI and TensorBoard on loopback and a short fresh run of
its own name, the two URLs printed before the first round; TensorBoard shows the run's nodes as runs of their
own while it trains (issue 50, item 5)."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from safetensors.torch import save_file

from spes.config.loader import load_params
from spes.model.transformer import CausalLM
from tests.conftest import prefect_home
from tests.pipelines.tiny_project import INIT_SEED, make_project

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _project(root, tiny_tokens, prefect_db):
    make_project(root, tiny_tokens)
    prefect_home(root / "prefect_home", prefect_db)
    p = load_params(str(root / "params.yaml"))
    torch.manual_seed(INIT_SEED)
    (root / "artifacts/init").mkdir()
    save_file(CausalLM(p.model).canonical_state_dict(), str(root / "artifacts/init/model.safetensors"))
    (root / "artifacts/init/config.json").write_text(json.dumps({"model_config": dataclasses.asdict(p.model),
                                                                 "source": "test"}))


def _env(root):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return dict(env, PYTHONPATH=ROOT, PREFECT_HOME=str(root / "prefect_home"))


def test_without_an_initial_model_it_says_what_to_run_and_starts_nothing(tmp_path, tiny_tokens):
    make_project(tmp_path, tiny_tokens)
    out = subprocess.run([sys.executable, "-m", "pipelines.watch", "--params", str(tmp_path / "params.yaml")],
                         cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    (line,) = out.stderr.strip().splitlines()
    assert "artifacts/init/model.safetensors does not exist" in line and "dvc repro upcycle" in line
    assert not (tmp_path / "storage").exists() and not (tmp_path / "artifacts/tensorboard").exists()


def test_a_bad_setting_is_one_line_before_anything_starts(tmp_path, tiny_tokens):
    make_project(tmp_path, tiny_tokens)
    out = subprocess.run([sys.executable, "-m", "pipelines.watch", "--params", str(tmp_path / "params.yaml"),
                          "--rounds", "0"], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == "watch: --rounds must be >= 1, got 0", out.stderr


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read()


@pytest.mark.slow
def test_one_command_starts_both_servers_and_a_run_to_watch(tmp_path, tiny_tokens, prefect_db):
    _project(tmp_path, tiny_tokens, prefect_db)
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.watch", "--params", str(tmp_path / "params.yaml"),
                             "--rounds", "2", "--name", "look"], cwd=ROOT, env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not any(line.startswith("watch: the servers stay up") for line in lines):
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        text = "".join(lines)
        assert "watch: run look: rounds 1-2 committed" in text, text
        urls = {line.split()[1]: line.split()[-1] for line in lines if line.startswith("watch: ")
                and line.split()[1] in ("Prefect", "TensorBoard")}
        assert urls["Prefect"].startswith("http://127.0.0.1:") and urls["TensorBoard"].startswith("http://127.0.0.1:")
        # printed before the first round, each once its server answered
        assert text.index("watch: TensorBoard") < text.index("rounds 1-2 committed")
        assert _get(urls["Prefect"])[0] == 200  # the UI, not only the API
        tb = urls["TensorBoard"]
        deadline = time.time() + 120
        while True:  # TensorBoard reads the events in the background: a run per node and the global one
            runs = set(json.loads(_get(f"{tb}/data/runs")[1]))
            if {"global", "node0", "node1"} <= runs:
                break
            assert time.time() < deadline, runs
            time.sleep(1)
        tags = json.loads(_get(f"{tb}/data/plugin/scalars/tags")[1])
        assert "loss/train" in tags["node0"] and "loss/train" in tags["node1"] and "loss/heldout" in tags["global"]
        proc.send_signal(signal.SIGINT)  # Ctrl-C: both servers end with the command
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (tmp_path / "storage" / "runs" / "look").is_dir() and not (tmp_path / "storage" / "runs" / "default").exists()
    for url in urls.values():
        with pytest.raises(OSError):
            _get(url)
