"""The CUDA checks of bench/gpu_check.py as tests (`pytest -m gpu`), at toy sizes: on a machine with a CUDA
device they assert what gpu_check reports (our MoE step runs in bf16 autocast, the Triton grouped GEMM agrees
with torch's grouped_mm, the chunked loss with the plain one, the memory planner with the allocator, a node
round on CUDA with the same round on the CPU); elsewhere each skips, saying so. The measured figures (sizes
of the paper's presets, tokens/s, MFU) stay gpu_check.py's: a timed test would only measure the machine."""
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")]

SMOKE = SimpleNamespace(smoke=True)


@pytest.fixture(scope="module")
def dev():
    return torch.device("cuda")


@pytest.fixture(scope="module")
def gpu_check():
    from bench import gpu_check

    return gpu_check


def test_our_moe_step_runs_in_bf16_beside_hugging_faces(gpu_check, dev):
    peak = gpu_check.check_matmul_peak(SMOKE, dev)["flops"]
    r = gpu_check.check_moe_step(SMOKE, dev, peak)
    assert "error" not in r, r
    assert r["ours_tokens_per_s"] > 0 and r["hf_tokens_per_s"] > 0


def test_the_triton_grouped_gemm_agrees_with_torchs_grouped_mm_in_bf16(gpu_check, dev):
    r = gpu_check.check_grouped_gemm(SMOKE, dev)
    assert "error" not in r.get("triton", {}), r
    assert r["triton"]["max_rel_err_y_vs_fp32"] < 2e-2
    if "triton_vs_grouped_mm" in r:  # torch builds without grouped_mm say so in r["grouped_mm"]
        assert max(r["triton_vs_grouped_mm"].values()) < 2e-2, r


def test_the_chunked_loss_equals_the_plain_one_and_holds_less(gpu_check, dev):
    r = gpu_check.check_chunked_loss(SMOKE, dev)
    assert r["loss_abs_err"] < 1e-4 and r["grad_h_max_rel_err"] < 1e-3 and r["grad_w_max_rel_err"] < 1e-3, r
    assert r["peak_gib_above_inputs_chunked"] <= r["peak_gib_above_inputs_plain"], r


def test_the_memory_planner_is_within_a_factor_of_the_allocator(gpu_check, dev):
    r = gpu_check.check_planner(SMOKE, dev)
    for row in r["cases"]:
        assert row["measured_gib"] > 0 and 0.5 <= row["planned_over_measured"] <= 2.0, row


def test_a_node_round_on_cuda_equals_the_cpu_round_to_bf16_tolerance(gpu_check, dev):
    r = gpu_check.check_node_round(SMOKE, dev)
    assert r["within_bf16_tolerance"], r
