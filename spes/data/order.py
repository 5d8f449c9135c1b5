"""The order in which nodes read training windows.

`epoch` (default): the token stream is cut into non-overlapping windows of seq_len+1 tokens; each epoch
visits them in a pseudo-random order (a keyed permutation computed per index, so a 100B-token corpus
needs no table), and node i of N takes every N-th window of it: nodes never see the same window within
an epoch, and every window is seen once per epoch (up to n_windows mod N left over). The next epoch
reshuffles. A node's stream is a pure function of (seed, node, N, position), so a resume needs only the
position (batches consumed).

`random_windows`: what the reference does: every batch draws window starts uniformly at random (with
replacement), per (seed, node, position).
"""
from __future__ import annotations

import math

import numpy as np

from spes.config.schema import DATA_ORDERS
from spes.errors import DataError

ORDERS = DATA_ORDERS
_M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)


class WindowPermutation:
    """A bijection of range(n), keyed by (seed, epoch): a 4-round Feistel network on the smallest even
    bit width >= log2(n), with cycle walking back into range."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise DataError(f"permutation of {n} items")
        self.n = n
        self.half = max(1, math.ceil(math.log2(max(2, n)) / 2))
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.default_rng([seed, epoch, 0x5EED]).integers(0, 2**63, self.ROUNDS, dtype=np.uint64)

    def _round(self, r: np.ndarray, key: np.uint64) -> np.ndarray:
        with np.errstate(over="ignore"):
            z = (r ^ key) * _M1
            z = (z ^ (z >> np.uint64(29))) * _M2
            return (z ^ (z >> np.uint64(32))) & self.mask

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(self.half), x & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << np.uint64(self.half)) | right

    def __call__(self, idx: np.ndarray) -> np.ndarray:
        out = self._feistel(np.asarray(idx, dtype=np.uint64))
        bad = out >= self.n
        while bad.any():  # cycle walking: the domain is at most 4n, so this ends after a few passes
            out[bad] = self._feistel(out[bad])
            bad = out >= self.n
        return out.astype(np.int64)


def epoch_window_starts(n_tokens: int, seq_len: int, seed: int, node: int, num_nodes: int,
                        first_sample: int, count: int) -> np.ndarray:
    """Token offsets of samples [first_sample, first_sample + count) of node `node`'s epoch stream."""
    window = seq_len + 1
    n_windows = n_tokens // window
    per_node = n_windows // num_nodes
    if per_node < 1:
        raise DataError(f"{n_windows} windows of {window} tokens cannot be split over {num_nodes} nodes")
    samples = np.arange(first_sample, first_sample + count, dtype=np.int64)
    epochs, within = samples // per_node, samples % per_node
    out = np.empty(count, dtype=np.int64)
    for e in np.unique(epochs):
        sel = epochs == e
        out[sel] = WindowPermutation(n_windows, seed, int(e))(node + num_nodes * within[sel])
    return out * window


def random_window_starts(n_tokens: int, seq_len: int, seed: int, node: int, position: int, count: int) -> np.ndarray:
    rng = np.random.default_rng([seed, node, position])
    return rng.integers(0, n_tokens - seq_len - 1, size=count)
