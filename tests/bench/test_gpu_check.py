"""bench/gpu_check.py runs end to end (--smoke: toy sizes on the CPU, Triton interpreted), so the one GPU check a
session with a device gets does not fail on a code path nobody ran; its CPU-checkable answers are right."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_the_gpu_check_runs_every_check_at_toy_sizes():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "bench/gpu_check.py", "--smoke"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    checks = ("env", "matmul_peak", "moe_step", "grouped_gemm", "chunked_loss", "planner", "node_round")
    assert r["smoke"] is True and all(k in r for k in checks)
    assert [k for k in checks if "error" in r[k]] == []
    assert r["moe_step"]["ours_tokens_per_s"] > 0 and r["moe_step"]["hf_tokens_per_s"] > 0
    assert max(r["grouped_gemm"]["triton_vs_grouped_mm"].values()) < 1e-5  # fp32 on the CPU
    c = r["chunked_loss"]
    assert c["loss_abs_err"] < 1e-5 and c["grad_h_max_rel_err"] < 1e-5 and c["grad_w_max_rel_err"] < 1e-5
    assert [row["micro_batch"] for row in r["planner"]["cases"]] == [1, 2]
    assert r["node_round"]["within_bf16_tolerance"] and r["node_round"]["loss_max_abs_diff"] == 0.0  # CPU twice


def test_the_gpu_check_refuses_to_measure_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    out = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0 and "no CUDA device here" in out.stderr
