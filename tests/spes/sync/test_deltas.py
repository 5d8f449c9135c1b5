"""What a node uploads: its trained tensors' delta, split into averaged tensors and its own expert rows."""
import torch

from spes.sync.codecs import make_codec
from spes.sync.deltas import EXPERTS_FILE, SHARED_FILE, encode_upload
from spes.sync.methods import sync_method
from tests.conftest import params_of

SPES, DILOCO = sync_method(params_of()), sync_method(params_of("sync.method=diloco"))


def test_encode_upload_splits_and_keeps_the_residual():
    prev = {"w": torch.zeros(3), "l.mlp.experts.down_proj": torch.zeros(4, 2, 2)}
    trained = {"w": torch.tensor([1.0, 2.0, 3.0]), "l.mlp.experts.down_proj": torch.ones(2, 2, 2)}  # rows 2, 3
    files, residual = encode_upload(SPES, make_codec("fp32"), prev, trained, (2, 3), None, True)
    assert set(files) == {SHARED_FILE, EXPERTS_FILE} and residual == {}
    assert files[SHARED_FILE]["w"].tolist() == [1.0, 2.0, 3.0]
    assert torch.equal(files[EXPERTS_FILE]["l.mlp.experts.down_proj"], torch.ones(2, 2, 2))
    prev["l.mlp.experts.down_proj"][2:] = 0.25
    files, residual = encode_upload(SPES, make_codec("int8", 256), prev, trained, (2, 3), None, True)
    assert set(files[EXPERTS_FILE]) == {"l.mlp.experts.down_proj", "l.mlp.experts.down_proj#scale"}
    assert torch.allclose(residual["l.mlp.experts.down_proj"], torch.zeros(2, 2, 2), atol=1e-7)  # 0.75 is exact
    full = {"w": torch.tensor([1.0, 2.0, 3.0]), "l.mlp.experts.down_proj": torch.ones(4, 2, 2)}
    files, _ = encode_upload(DILOCO, make_codec("fp32"), {k: torch.zeros_like(v) for k, v in full.items()}, full, (0, 1, 2, 3), None, True)
    assert set(files) == {SHARED_FILE} and files[SHARED_FILE]["l.mlp.experts.down_proj"].shape == (4, 2, 2)
