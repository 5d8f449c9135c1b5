import pytest
import torch

from spes.config.schema import OptimConfig
from spes.errors import DeviceError
from spes.model.moe import TopKRouter
from spes.model.transformer import CausalLM
from spes.train.devices import resolve_device
from spes.train.trainer import Trainer
from tests.conftest import tiny_config


def test_resolve_device():
    assert resolve_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(DeviceError, match="auto\\|cpu\\|cuda"):
        resolve_device("gpu")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        assert resolve_device("auto", 5) == torch.device("cuda", 5 % n)
        with pytest.raises(DeviceError, match="CUDA device"):
            resolve_device(f"cuda:{n}")
    else:
        assert resolve_device("auto", 5) == torch.device("cpu")
        with pytest.raises(DeviceError, match="sees no CUDA device"):
            resolve_device("cuda:0")


def test_router_stays_fp32_under_autocast():
    router = TopKRouter(16, 4, 2, True)
    x = torch.randn(6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = router(x)
    assert r.logits_TE.dtype == torch.float32
    assert torch.equal(r.logits_TE, torch.nn.functional.linear(x, router.weight))


def test_bf16_autocast_step_tracks_fp32_and_hands_out_fp32_on_cpu():
    torch.manual_seed(0)
    ref = CausalLM(tiny_config())
    sd = {k: v.clone() for k, v in ref.canonical_state_dict().items()}
    x = torch.randint(0, 96, (2, 12))
    losses = {}
    for dtype in (None, "bfloat16"):
        m = CausalLM(tiny_config())
        m.load_canonical_state_dict(sd)
        tr = Trainer(m, [0, 1], OptimConfig(lr=1e-2, warmup_steps=1), 10, autocast_dtype=dtype)
        metrics = tr.train_step(x, x, 0)
        assert metrics.ce.ndim == 0 and metrics.ce.device == tr.device  # no host sync in the step
        losses[dtype] = float(metrics.ce)
        up = tr.upload()
        assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in up.values())
    assert losses["bfloat16"] != losses[None] and abs(losses["bfloat16"] - losses[None]) < 0.05
