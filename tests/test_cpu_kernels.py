"""The CPU kernels the library pins (spes/__init__.py): a machine with AVX-512 trains like one without,
bit for bit; the environment's own choice wins; nothing changes once torch was imported first."""
import os
import platform
import subprocess
import sys

import pytest

from spes import CPU_KERNELS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLEAN = {k: v for k, v in os.environ.items() if k not in {*CPU_KERNELS, "MKL_ENABLE_INSTRUCTIONS", "TORCHINDUCTOR_CACHE_DIR"}}
CAPABILITY = "import torch; print(torch.backends.cpu.get_cpu_capability())"
STEPS = """
import torch
from spes.config.schema import ModelConfig
from spes.model.transformer import CausalLM
torch.manual_seed(0)
cfg = ModelConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                  num_experts=4, top_k=2, max_seq_len=64)
model = CausalLM(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
for _ in range(5):
    x = torch.randint(0, cfg.vocab_size, (4, 33), generator=g)
    logits = model(x[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
print(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().sum().item().hex(), loss.item().hex())
"""


def _python(code: str, **env) -> str:
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**CLEAN, **env}, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip()


NATIVE = _python(CAPABILITY) if platform.machine().lower() in ("x86_64", "amd64") else "not x86-64"
pytestmark = pytest.mark.skipif(NATIVE not in ("AVX2", "AVX512"), reason=f"needs an x86-64 CPU with AVX2 ({NATIVE})")


@pytest.mark.parametrize("entry", ["stages.rounds", "pipelines.node_flow", "spes.round.node"])
def test_every_entry_point_runs_the_avx2_kernels(entry):
    cache = "import os; print(os.path.basename(os.environ['TORCHINDUCTOR_CACHE_DIR']).rpartition('_')[2])"
    assert _python(f"import {entry}; {CAPABILITY}; {cache}") == "AVX2\navx2"  # compiled kernels kept apart


def test_the_environments_choice_wins_and_an_earlier_torch_is_left_alone():
    assert _python(f"import spes; {CAPABILITY}", ATEN_CPU_CAPABILITY="default") == "DEFAULT"
    assert _python(f"import torch, spes, os; {CAPABILITY}; print(os.environ.get('ATEN_CPU_CAPABILITY'))") \
        == f"{NATIVE}\nNone"


def test_training_here_equals_training_on_a_machine_without_avx512():
    """This code on a machine without AVX-512, emulated by capping each library's instruction set (ATen,
    MKL, oneDNN) as such a CPU would: the library's own settings come on top, as they would there."""
    pinned = _python("import spes\n" + STEPS)
    without_avx512 = _python("import spes\n" + STEPS, ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2",
                             ONEDNN_MAX_CPU_ISA="AVX2")
    assert pinned == without_avx512
    if NATIVE == "AVX512":  # the kernels this machine would choose by itself do differ: the pinning matters
        assert _python(STEPS) != pinned
