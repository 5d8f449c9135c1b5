"""Codecs: exact numbers for each, error feedback bounded, bad input refused."""
import pytest
import torch

from spes.errors import CodecError
from spes.sync.codecs import make_codec
from spes.sync.deltas import encode_with_feedback


def test_fp32_and_bf16():
    x = torch.tensor([1.0, -2.5, 3.14159265, 1e-8])
    fp32 = make_codec("fp32")
    assert torch.equal(fp32.decode("w", fp32.encode("w", x), (4,)), x)
    bf16 = make_codec("bf16")
    parts = bf16.encode("w", x)
    assert parts["w"].dtype == torch.bfloat16
    assert torch.equal(bf16.decode("w", parts, (4,)), x.bfloat16().float())


def test_int8_blockwise_absmax_exact():
    c = make_codec("int8", int8_block=4)
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0, 8.0], [0.0, 0.0, 0.0, 3.0, -0.0]])  # 10 values: blocks of 4, 4, 2
    parts = c.encode("w", x)
    assert parts["w"].dtype == torch.int8 and tuple(parts["w"].shape) == (2, 5)
    assert parts["w#scale"].tolist() == pytest.approx([4 / 127, 8 / 127, 3 / 127])
    assert parts["w"].flatten().tolist() == [32, -64, 16, 127, 127, 0, 0, 0, 127, 0]  # round(x / scale)
    y = c.decode("w", parts, (2, 5))
    scale = torch.tensor([4 / 127] * 4 + [8 / 127] * 4 + [3 / 127] * 2).view(2, 5)
    assert ((y - x).abs() <= scale / 2 + 1e-7).all()
    assert y[0, 3].item() == pytest.approx(4.0) and y[0, 4].item() == pytest.approx(8.0)
    assert c.decode("z", c.encode("z", torch.zeros(3)), (3,)).tolist() == [0.0, 0.0, 0.0]  # all-zero block


def test_error_feedback_keeps_the_sum_within_one_quantum():
    c = make_codec("int8", int8_block=8)
    torch.manual_seed(0)
    x = torch.randn(8) * 1e-3
    x[0] = 1.0  # one large value makes the small ones vanish without feedback
    sent, residual = torch.zeros(8), None
    for _ in range(50):
        parts, res = encode_with_feedback(c, "w", x, residual, keep=True)
        sent += c.decode("w", parts, (8,))
        residual = {"w": res}
    quantum = 1.0 / 127
    assert ((sent - 50 * x).abs() <= quantum).all()  # without feedback the small values would sum to 0
    no_fb = c.decode("w", c.encode("w", x), (8,))
    assert (no_fb[1:] == 0).all()


def test_bad_codec_input():
    with pytest.raises(CodecError, match="unknown codec 'int4'"):
        make_codec("int4")
    c = make_codec("int8")
    with pytest.raises(CodecError, match="not an int8 delta of shape"):
        c.decode("w", {"w": torch.zeros(3, dtype=torch.int8)}, (3,))
    with pytest.raises(CodecError, match="fp32 delta of shape"):
        make_codec("fp32").decode("w", {"w": torch.zeros(2)}, (3,))
