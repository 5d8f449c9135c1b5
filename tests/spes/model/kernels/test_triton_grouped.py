"""The Triton grouped GEMM (spes/model/kernels/triton_grouped.py) against the per-expert loop, on the CPU through
Triton's interpreter; on a GPU machine the same kernels compile for CUDA."""
import os

import pytest
import torch

_saved = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # read when triton's and our kernels are decorated: at first import
pytest.importorskip("triton")
from spes.model.kernels.triton_grouped import triton_grouped_linear  # noqa: E402

if _saved is None:
    del os.environ["TRITON_INTERPRET"]  # other tests' subprocesses stay uninterpreted
else:
    os.environ["TRITON_INTERPRET"] = _saved

from spes.config.schema import OptimConfig  # noqa: E402
from spes.model.transformer import CausalLM
from spes.train.trainer import Trainer  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # also read when the kernels run


def loop_reference(x, w, counts):
    outs = [xe @ w[e].t() for e, xe in enumerate(torch.split(x, counts.tolist()))]
    return torch.cat(outs)


@pytest.mark.parametrize("counts", [[7, 0, 33, 1, 19], [0, 0, 64, 0, 0], [40, 40, 40, 40, 40], [0, 0, 0, 0, 0]])
def test_forward_and_backward_match_the_loop(counts):
    torch.manual_seed(0)
    counts = torch.tensor(counts)
    E, N, K = 5, 48, 40  # not multiples of the 32-wide tiles: masks are exercised
    x = torch.randn(int(counts.sum()), K, requires_grad=True)
    w = torch.randn(E, N, K, requires_grad=True)
    y = triton_grouped_linear(x, w, counts)
    g = torch.randn_like(y)
    y.backward(g)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_ref = loop_reference(x_ref, w_ref, counts) if counts.sum() else x_ref.new_zeros(0, N)
    if counts.sum():
        y_ref.backward(g)
    else:
        w_ref.grad = torch.zeros_like(w_ref)
        x_ref.grad = torch.zeros_like(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-5)
    if counts[1] == 0:
        assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))  # an expert without rows gets exactly 0


def test_frozen_weights_get_no_weight_grad():
    torch.manual_seed(1)
    counts = torch.tensor([5, 11, 0, 16])
    x = torch.randn(32, 16, requires_grad=True)
    w = torch.randn(4, 24, 16)  # frozen: requires_grad=False
    triton_grouped_linear(x, w, counts).sum().backward()
    assert w.grad is None
    x_ref = x.detach().clone().requires_grad_()
    loop_reference(x_ref, w, counts).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)


def test_spes_node_step_with_triton_experts_matches_loop():
    """A node owning experts {1, 2} of 4 (three chunks: frozen, trainable, frozen), one training step."""
    torch.manual_seed(2)
    base = CausalLM(tiny_config())
    sd = {k: v.clone() for k, v in base.canonical_state_dict().items()}
    x = torch.randint(0, 96, (2, 12))
    after = {}
    for impl in ("loop", "triton"):
        m = CausalLM(tiny_config(experts_impl=impl))
        m.load_canonical_state_dict(sd)
        tr = Trainer(m, [1, 2], OptimConfig(lr=1e-2, warmup_steps=1), 10)
        tr.train_step(x, x, 0)
        after[impl] = m.canonical_state_dict()
    for k in after["loop"]:
        torch.testing.assert_close(after["triton"][k], after["loop"][k], rtol=1e-4, atol=1e-5)
