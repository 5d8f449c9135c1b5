"""MoE compute: chunked experts and every expert implementation compute the same function."""
import subprocess
import sys

import pytest
import torch

from spes.model.moe import experts_impl, grouped_linear
from spes.model.transformer import CausalLM
from tests.conftest import ROOT, tiny_config


def test_chunked_experts_compute_the_same_function():
    torch.manual_seed(4)
    model = CausalLM(tiny_config()).eval()
    x = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        ref = model(x).logits
        model.set_trainable_experts([1, 3])
        assert len(model.moe_layers()[0].experts.chunks) == 4
        assert torch.allclose(model(x).logits, ref, atol=1e-6)


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_grouped_linear_matches_per_expert_matmuls(impl):
    torch.manual_seed(5)
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(3, 12, 8, requires_grad=True)
    counts = torch.tensor([4, 0, 6])
    y = grouped_linear(x, w, counts, impl=impl)
    ref = torch.cat([x[:4] @ w[0].t(), x[4:] @ w[2].t()])
    assert torch.allclose(y, ref, atol=1e-5)
    y.sum().backward()  # stride-0 gradient must be accepted
    assert w.grad[1].abs().sum().item() == 0.0


def test_experts_impl_comes_from_the_config():
    x, w = torch.randn(4, 8), torch.randn(2, 8, 8)
    assert experts_impl("auto", x, w) == "grouped_mm"  # CPU fp32 with aligned strides
    assert experts_impl("loop", x, w) == "loop"
    with pytest.raises(ValueError, match="experts_impl"):
        experts_impl("fast", x, w)
    torch.manual_seed(6)
    ids = torch.randint(0, 96, (2, 7))
    outs = {}
    for impl in ("grouped_mm", "loop"):
        torch.manual_seed(6)
        m = CausalLM(tiny_config(experts_impl=impl)).eval()
        assert m.moe_layers()[0].experts.impl == impl
        with torch.no_grad():
            outs[impl] = m(ids).logits
    torch.testing.assert_close(outs["grouped_mm"], outs["loop"], rtol=1e-5, atol=1e-5)


def test_importing_the_model_loads_neither_dynamo_nor_triton():
    # A triton imported before TRITON_INTERPRET is set cannot interpret kernels (the kernel tests need it),
    # and a stage that never compiles should not pay for importing dynamo.
    code = "import sys, spes.model.transformer, spes.train.trainer; print('triton' in sys.modules, 'torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]
