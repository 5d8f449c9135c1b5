"""Token data: shards read as one sequence, the epoch order (disjoint across nodes, every window once per
epoch, resumable), deterministic streams, whole-split evaluation windows, clear errors."""
import json

import numpy as np
import pytest
import torch

from spes.data.order import WindowPermutation, epoch_window_starts
from spes.data.shards import ShardWriter, TokenSequence
from spes.data.tokens import BatchStream, TokenData, check_vocab, eval_batches
from spes.errors import DataError


def test_shards_read_as_one_sequence(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    ends = np.arange(10, 1001, 10)  # 100 documents of 10 tokens
    w = ShardWriter(str(tmp_path), "train", np.uint16, 95)
    w.add(tokens[:500], ends[:50])
    w.add(tokens[500:], ends[50:] - 500)
    shards = w.finish()
    assert [s["tokens"] for s in shards] == [90] * 11 + [10] and sum(s["documents"] for s in shards) == 100
    seq = TokenSequence.open(str(tmp_path), shards, np.uint16)
    assert len(seq) == 1000 and np.array_equal(np.asarray(seq), tokens)
    assert np.array_equal(seq.read(85, 200), tokens[85:285])  # across three shards
    starts = np.array([0, 89, 170, 975])
    assert np.array_equal(seq.windows(starts, 25), np.stack([tokens[s:s + 25] for s in starts]).astype(np.int64))
    with pytest.raises(IndexError):
        seq.read(990, 11)


def test_a_document_larger_than_a_shard_gets_a_shard_of_its_own(tmp_path):
    w = ShardWriter(str(tmp_path), "val", np.uint16, 8)
    w.add(np.arange(30, dtype=np.uint16), np.array([3, 23, 30]))
    assert [(s["tokens"], s["documents"]) for s in w.finish()] == [(3, 1), (20, 1), (7, 1)]


def test_window_permutation_is_a_bijection():
    for n in (1, 2, 7, 64, 1000, 4097):
        got = WindowPermutation(n, seed=5, epoch=2)(np.arange(n))
        assert sorted(got.tolist()) == list(range(n))
    a, b = WindowPermutation(1000, 5, 0)(np.arange(1000)), WindowPermutation(1000, 5, 1)(np.arange(1000))
    assert not np.array_equal(a, b)  # reshuffled per epoch


def test_epoch_order_is_disjoint_across_nodes_and_covers_every_window_once():
    n_tokens, seq_len, nodes = 33 * 100 + 7, 32, 3  # 100 windows of 33 tokens; 1 left over per epoch
    per_node = 100 // nodes
    seen = [epoch_window_starts(n_tokens, seq_len, 9, i, nodes, 0, per_node) for i in range(nodes)]
    flat = np.concatenate(seen)
    assert len(set(flat.tolist())) == len(flat) == 99  # disjoint, no window twice
    assert all(s % 33 == 0 and s + 33 <= n_tokens for s in flat.tolist())  # non-overlapping windows
    again = epoch_window_starts(n_tokens, seq_len, 9, 1, nodes, 0, per_node)
    assert np.array_equal(again, seen[1])  # same seed, same order
    epoch2 = [epoch_window_starts(n_tokens, seq_len, 9, i, nodes, per_node, per_node) for i in range(nodes)]
    assert len(set(np.concatenate(epoch2).tolist())) == 99 and not np.array_equal(epoch2[1], seen[1])  # reshuffled
    other = epoch_window_starts(n_tokens, seq_len, 10, 1, nodes, 0, per_node)
    assert not np.array_equal(other, seen[1])


@pytest.mark.parametrize("order", ["epoch", "random_windows"])
def test_stream_is_a_function_of_seed_node_position(order):
    tokens = np.arange(1000) % 97
    a = BatchStream(tokens, 4, 16, seed=3, node=1, order=order, num_nodes=2)
    first = [a.next() for _ in range(5)]
    resumed = BatchStream(tokens, 4, 16, seed=3, node=1, position=3, order=order, num_nodes=2)
    assert all(torch.equal(x, y) for x, y in zip(resumed.next(), first[3]))
    other = BatchStream(tokens, 4, 16, seed=3, node=0, order=order, num_nodes=2).next()
    assert not torch.equal(other[0], first[0][0])
    x, y = first[0]
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])  # labels are the inputs shifted by one


def test_random_windows_keep_the_reference_sampling():
    """random_windows is what the stream always did: starts from default_rng([seed, node, position])."""
    tokens = np.arange(500)
    x, _ = BatchStream(tokens, 3, 8, seed=1, node=2, position=4, order="random_windows").next()
    starts = np.random.default_rng([1, 2, 4]).integers(0, 500 - 8 - 1, size=3)
    assert torch.equal(x, torch.from_numpy(np.stack([tokens[s:s + 8] for s in starts])))


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
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 512, "dtype": "uint16"}))
    with pytest.raises(DataError, match="format 'spes-tokens/1', not 'spes-tokens/2'; run the tokenize stage again"):
        TokenData.open(str(tmp_path))
    with pytest.raises(DataError, match="fewer than the 4 nodes"):
        BatchStream(np.arange(100), 2, 30, seed=0, node=0, num_nodes=4)


def test_spread_held_out_windows_cover_the_split_evenly():
    from spes.data.tokens import eval_window_starts

    assert eval_window_starts(101, 10, 3).tolist() == [0, 10, 20]
    assert eval_window_starts(101, 10, 3, spread=True).tolist() == [0, 30, 60]  # 10 windows, every 10/3rd
    assert eval_window_starts(101, 10, 20, spread=True).tolist() == list(range(0, 100, 10))  # all there are
    x = [x for x, _ in eval_batches(np.arange(101), 2, 10, num_batches=2, spread=True)]
    assert torch.equal(torch.cat(x)[:, 0], torch.tensor([0, 20, 50, 70]))


def test_held_out_windows_capped_per_document():
    from spes.data.tokens import heldout_window_starts

    # documents of 100, 20 and 50 tokens (EOS = 0 ends each): 16 windows of 10, of documents 0 (10 windows),
    # 1 (2 windows) and 2 (4 windows) by their first token
    tokens = np.ones(170, dtype=np.int64)
    tokens[[99, 119, 169]] = 0
    assert heldout_window_starts(tokens, 0, 10).tolist() == list(range(0, 160, 10))  # no cap: every window
    capped = [0, 30, 60, 100, 110, 120, 130, 140]  # at most 3 a document, a longer one's spread over it
    assert heldout_window_starts(tokens, 0, 10, max_per_document=3).tolist() == capped
    assert heldout_window_starts(tokens, 0, 10, 4, spread=True, max_per_document=3).tolist() == [0, 60, 110, 130]
    assert heldout_window_starts(tokens, 0, 10, 2, max_per_document=3).tolist() == [0, 30]
    assert heldout_window_starts(tokens, 0, 10, max_per_document=100).tolist() == list(range(0, 160, 10))
