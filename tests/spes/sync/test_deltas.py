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


def test_the_overlap_fold_in_counts_the_nodes_own_update_once_and_takes_others_committed_values():
    from spes.sync.deltas import own_delta, with_own_delta

    g = torch.Generator().manual_seed(0)
    name, shared = "l.mlp.experts.down_proj", "w"
    sent = {shared: torch.randn(5, generator=g), name: torch.randn(4, 3, generator=g)}  # what the node uploaded in r
    local = {shared: sent[shared] + torch.randn(5, generator=g),  # round r+1 trained on from `sent`: rows 2, 3 its own
             name: torch.cat([sent[name][:2], sent[name][2:] + torch.randn(2, 3, generator=g)])}
    global_r = {shared: torch.randn(5, generator=g), name: torch.randn(4, 3, generator=g)}  # arrived meanwhile
    trained = {shared: local[shared], name: local[name][2:]}  # the trainer's upload: the owned rows
    d = own_delta(SPES, sent, trained, (2, 3))
    assert torch.equal(d[shared], local[shared] - sent[shared]) and torch.equal(d[name], local[name][2:] - sent[name][2:])
    folded = with_own_delta(SPES, global_r, d, (2, 3))
    # theta <- global_r + (theta_local - theta_sent): the node's own update once, on top of the committed global
    assert torch.equal(folded[shared], global_r[shared] + (local[shared] - sent[shared]))
    assert torch.equal(folded[name][2:], global_r[name][2:] + (local[name][2:] - sent[name][2:]))
    assert torch.equal(folded[name][:2], global_r[name][:2])  # others' experts: exactly their committed values
    assert torch.allclose(folded[name], local[name] + (global_r[name] - sent[name]), atol=1e-6)  # the form
    assert global_r[name].data_ptr() != folded[name].data_ptr()  # the committed global is left as it was
    everything = own_delta(DILOCO, sent, local, (0, 1, 2, 3))  # a method averaging everything: every row its own
    assert torch.equal(with_own_delta(DILOCO, global_r, everything, (0, 1, 2, 3))[name], global_r[name] + (local[name] - sent[name]))
