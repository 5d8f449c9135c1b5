"""Every entry point says what it does on --help (exit 0), and a stage run too early says so in one line, at once."""
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

ENTRY_POINTS = {"stages.tokenize": "Reads the corpus", "stages.dense": "Reads artifacts/tokens",
                "stages.upcycle": "writes artifacts/init", "stages.rounds": "warmup", "stages.evaluate": "Reads",
                "stages.compare": "compare", "spes.config": "set-params", "spes.plan": "--gpu-mem", "spes.members": "join",
                "pipelines.serve": "deployment", "pipelines.node_flow": "GPU machine"}


@pytest.mark.parametrize("module,phrase", sorted(ENTRY_POINTS.items()))
def test_help(module, phrase):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "usage:" in r.stdout and phrase in r.stdout, r.stdout + r.stderr


def test_train_before_the_earlier_stages_says_which_to_run_at_once(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(f"artifacts_dir: {tmp_path / 'artifacts'}\nstorage: {{url: {tmp_path / 'storage'}}}\n")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "stages.rounds", "train", "--params", str(params)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and time.time() - t0 < 30
    assert r.stderr.strip().splitlines()[-1].startswith("rounds: ") and "dvc repro upcycle" in r.stderr


def test_node_flow_refuses_to_serve_without_an_api_url():
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    r = subprocess.run([sys.executable, "-m", "pipelines.node_flow"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "PREFECT_API_URL is not set" in r.stderr


@pytest.mark.parametrize("argv", [["stages.rounds", "train", "--params", "params.yaml", "sync.rounds=0"],
                                  ["stages.rounds", "train", "sync.rounds=0", "--params", "params.yaml"],
                                  ["spes.plan", "sync.rounds=0", "--json"]])
def test_overrides_go_anywhere_on_the_line(argv):
    """An override after an option is an override (as OmegaConf/Hydra users expect), not 'unrecognized'."""
    r = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "sync.rounds must be >= 1, got 0" in r.stderr and "unrecognized" not in r.stderr, r.stderr
