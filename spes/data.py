"""Tokenized data: flat token shards (numpy memmap) and deterministic, resumable batch streams.

A shard is `<name>.bin` (uint16 or uint32 tokens, documents joined with EOS) plus `meta.json`.
A node's stream is a pure function of (seed, node, position): batch p draws its window starts from a
generator seeded by (seed, node, p), so resuming needs only the position.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


class DataError(ValueError):
    pass


def write_shard(path: str, tokens: np.ndarray) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    tokens.tofile(tmp)
    os.replace(tmp, path)  # never leave a half-written shard under the real name


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


@dataclass
class TokenData:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    """The tokenizer's vocabulary: every id is below it."""
    eos_id: int

    @classmethod
    def open(cls, folder: str) -> "TokenData":
        meta_path = os.path.join(folder, "meta.json")
        if not os.path.exists(meta_path):
            raise DataError(f"no token data at {folder!r} (missing meta.json); run the tokenize stage first")
        with open(meta_path) as f:
            meta = json.load(f)
        dtype = np.dtype(meta["dtype"])
        arrays = {}
        for split in ("train", "val"):
            p = os.path.join(folder, f"{split}.bin")
            if not os.path.exists(p):
                raise DataError(f"token shard missing: {p}")
            size = os.path.getsize(p)
            if size % dtype.itemsize or size // dtype.itemsize != meta[f"{split}_tokens"]:
                raise DataError(f"token shard {p} has {size} bytes, meta.json says {meta[f'{split}_tokens']} "
                                f"{dtype.name} tokens: truncated or foreign file")
            arrays[split] = np.memmap(p, dtype=dtype, mode="r")
        # ids are < the tokenizer's vocabulary (older folders only recorded the model's vocab_size)
        return cls(arrays["train"], arrays["val"], int(meta.get("tokenizer_vocab", meta["vocab_size"])),
                   int(meta["eos_id"]))


def check_vocab(model_vocab_size: int, data: TokenData, where: str) -> None:
    """Refuse token ids the model cannot embed, before any compute (else an IndexError deep in a step)."""
    if data.vocab_size > model_vocab_size:
        raise DataError(f"model.vocab_size ({model_vocab_size}) is smaller than the tokenizer's vocabulary "
                        f"({data.vocab_size}) of the token data at {where}; raise model.vocab_size or retokenize")


def _window_batch(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    chunk = torch.from_numpy(tokens[idx].astype(np.int64))
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


class BatchStream:
    """Random windows of seq_len+1 tokens; position = batches already consumed."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, node: int, position: int = 0):
        if len(tokens) < seq_len + 2:
            raise DataError(f"only {len(tokens)} tokens, need more than seq_len+1={seq_len + 1}")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.seed, self.node, self.position = seed, node, position

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.node, self.position])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
        self.position += 1
        return _window_batch(self.tokens, starts, self.seq_len)


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, num_batches: Optional[int] = None):
    """Fixed, non-overlapping windows from the start of the held-out split (same for every model): the
    first `num_batches` batches, or all of it (None)."""
    n_windows = (len(tokens) - 1) // seq_len
    if num_batches is not None:
        n_windows = min(num_batches * batch_size, n_windows)
    if n_windows == 0:
        raise DataError(f"held-out split has {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
    starts = np.arange(n_windows) * seq_len
    for i in range(0, n_windows, batch_size):
        yield _window_batch(tokens, starts[i:i + batch_size], seq_len)
