"""Token data: deterministic resumable streams, whole-split evaluation windows, clear errors."""
import numpy as np
import pytest
import torch

from spes.data import BatchStream, DataError, TokenData, check_vocab, eval_batches


def test_stream_is_a_function_of_seed_node_position():
    tokens = np.arange(1000) % 97
    a = BatchStream(tokens, 4, 16, seed=3, node=1)
    first = [a.next() for _ in range(5)]
    resumed = BatchStream(tokens, 4, 16, seed=3, node=1, position=3)
    assert all(torch.equal(x, y) for x, y in zip(resumed.next(), first[3]))
    other = BatchStream(tokens, 4, 16, seed=3, node=0).next()
    assert not torch.equal(other[0], first[0][0])
    x, y = first[0]
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])  # labels are the inputs shifted by one


def test_eval_windows_cover_the_whole_split_unless_capped():
    tokens = np.arange(101)
    batches = list(eval_batches(tokens, 3, 10))
    assert sum(len(x) for x, _ in batches) == 10  # (101 - 1) // 10 windows
    assert batches[0][0][1, 0].item() == 10 and batches[-1][1][-1, -1].item() == 100
    assert sum(len(x) for x, _ in eval_batches(tokens, 3, 10, num_batches=2)) == 6
    with pytest.raises(DataError, match="fewer than one window"):
        list(eval_batches(np.arange(5), 1, 10))


def test_token_folder_errors(tiny_tokens, tmp_path):
    data = TokenData.open(tiny_tokens)
    assert data.vocab_size <= 512 and data.train.dtype == np.uint16
    with pytest.raises(DataError, match=r"model.vocab_size \(100\) is smaller than the tokenizer's vocabulary"):
        check_vocab(100, data, tiny_tokens)
    check_vocab(512, data, tiny_tokens)
    with pytest.raises(DataError, match="run the tokenize stage first"):
        TokenData.open(str(tmp_path))
