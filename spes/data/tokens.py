"""Tokenized data: a folder of token shards with its index, and deterministic, resumable batch streams.

    <folder>/meta.json          the index: format, dtype, vocabulary, EOS id, per split its shards
                                (file, tokens, documents, sha256); written last, so it marks a complete folder
    <folder>/train-000000.bin   token shards (spes/data/shards.py), memory-mapped as one sequence per split
    <folder>/val-000000.bin
    <folder>/tokenizer.json

A node's stream is a pure function of (order, seed, node, number of nodes, position), so a resume needs
only the position (batches consumed); see spes/data/order.py for the two orders.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import numpy as np
import torch

from spes.data.order import ORDERS, epoch_window_starts, random_window_starts
from spes.data.shards import TokenSequence
from spes.errors import DataError

FORMAT = "spes-tokens/2"
Tokens = Union[TokenSequence, np.ndarray]


_VERIFIED: set[tuple[str, int, int, str]] = set()
"""Shards this process has hashed (path, size, mtime, sha256): each is read in full once per process."""


def verify_shard(path: str, sha256: Optional[str]) -> None:
    """A shard's bytes against the sha256 in the index: ids changed in place (same size) are caught before any
    training reads them. Once per process and file (about 1 GB/s on one core)."""
    if not sha256:
        raise DataError(f"{path}: the index (meta.json) has no sha256 for it; run the tokenize stage again")
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, sha256)
    if key in _VERIFIED:
        return
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != sha256:
        raise DataError(f"token shard {path}: sha256 {h.hexdigest()[:12]} differs from its index ({sha256[:12]}): "
                        "changed after tokenization; run the tokenize stage again")
    _VERIFIED.add(key)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def as_sequence(tokens: Tokens) -> TokenSequence:
    return tokens if isinstance(tokens, TokenSequence) else TokenSequence([np.asarray(tokens)])


@dataclass
class TokenData:
    train: TokenSequence
    val: TokenSequence
    vocab_size: int
    """The tokenizer's vocabulary: every id is below it."""
    eos_id: int
    meta: dict
    folder: str

    @classmethod
    def open(cls, folder: str) -> "TokenData":
        """Open a complete token folder; shard sizes are checked against the index (sha256 is checked where
        shards cross machines: spes/run/token_share.py)."""
        meta_path = os.path.join(folder, "meta.json")
        if not os.path.exists(meta_path):
            raise DataError(f"no token data at {folder!r} (missing meta.json); run the tokenize stage first")
        try:
            with open(meta_path, "rb") as f:
                meta = json.loads(f.read())
            if not isinstance(meta, dict):
                raise DataError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"{meta_path}: not a token index ({e}); run the tokenize stage again") from None
        if meta.get("format") != FORMAT:
            raise DataError(f"token data at {folder!r} is in format {meta.get('format', 'spes-tokens/1')!r}, not "
                            f"{FORMAT!r}; run the tokenize stage again")
        splits = meta.get("splits")
        if not isinstance(splits, dict) or not all(
                isinstance(splits.get(s), dict) and isinstance(splits[s].get("shards"), list) for s in ("train", "val")):
            raise DataError(f"{meta_path}: not a token index (no train and val splits with shards); run the tokenize "
                            "stage again")
        try:
            return cls._open_splits(folder, meta_path, meta)
        except (KeyError, TypeError) as e:
            raise DataError(f"{meta_path}: damaged token index (missing or wrong {e}); run the tokenize stage "
                            "again") from None

    @classmethod
    def _open_splits(cls, folder: str, meta_path: str, meta: dict) -> "TokenData":
        dtype = np.dtype(meta["dtype"])
        splits = {}
        for split in ("train", "val"):
            shards = meta["splits"][split]["shards"]
            for s in shards:
                p = os.path.join(folder, s["file"])
                if os.path.basename(s["file"]) != s["file"]:
                    raise DataError(f"{meta_path}: refusing shard name {s['file']!r}")
                if not os.path.exists(p):
                    raise DataError(f"token shard missing: {p}")
                size = os.path.getsize(p)
                if size != s["tokens"] * dtype.itemsize:
                    raise DataError(f"token shard {p} has {size} bytes, meta.json says {s['tokens']} {dtype.name} "
                                    "tokens: truncated or foreign file")
                verify_shard(p, s.get("sha256"))
            splits[split] = TokenSequence.open(folder, shards, dtype)
        return cls(splits["train"], splits["val"], int(meta["tokenizer_vocab"]), int(meta["eos_id"]), meta, folder)



def write_index(folder: str, splits: dict[str, list[dict]], dtype: np.dtype, vocab_size: int, tokenizer_vocab: int,
                eos_id: int, extra: Optional[dict] = None) -> dict:
    """Write meta.json (last: a folder without it is incomplete)."""
    meta = {"format": FORMAT, "dtype": np.dtype(dtype).name, "vocab_size": vocab_size,
            "tokenizer_vocab": tokenizer_vocab, "eos_id": eos_id, **(extra or {}),
            "splits": {k: {"tokens": sum(s["tokens"] for s in v), "documents": sum(s["documents"] for s in v),
                           "shards": v} for k, v in splits.items()}}
    tmp = os.path.join(folder, "meta.json.part")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(folder, "meta.json"))
    return meta


def check_vocab(model_vocab_size: int, data: TokenData, where: str) -> None:
    """Refuse token ids the model cannot embed, before any compute (else an IndexError deep in a step)."""
    if data.vocab_size > model_vocab_size:
        raise DataError(f"model.vocab_size ({model_vocab_size}) is smaller than the tokenizer's vocabulary "
                        f"({data.vocab_size}) of the token data at {where}; raise model.vocab_size or retokenize")


def _window_batch(tokens: TokenSequence, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    chunk = torch.from_numpy(tokens.windows(starts, seq_len + 1))
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


class BatchStream:
    """Batches of windows of seq_len+1 tokens in the given order; position = batches already consumed.

    order='epoch': node `node` of `num_nodes` reads its disjoint share of each epoch's permutation of
    non-overlapping windows; 'random_windows': uniformly random window starts (the reference's sampling)."""

    def __init__(self, tokens: Tokens, batch_size: int, seq_len: int, seed: int, node: int, position: int = 0,
                 order: str = "epoch", num_nodes: int = 1):
        tokens = as_sequence(tokens)
        if order not in ORDERS:
            raise DataError(f"unknown data order {order!r} (known: {', '.join(ORDERS)})")
        if len(tokens) < seq_len + 2:
            raise DataError(f"only {len(tokens)} tokens, need more than seq_len+1={seq_len + 1}")
        if order == "epoch" and len(tokens) // (seq_len + 1) < num_nodes:
            raise DataError(f"{len(tokens)} tokens make {len(tokens) // (seq_len + 1)} windows of {seq_len + 1}: "
                            f"fewer than the {num_nodes} nodes that share them")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.seed, self.node, self.position, self.order, self.num_nodes = seed, node, position, order, num_nodes

    def starts(self, position: int) -> np.ndarray:
        if self.order == "epoch":
            return epoch_window_starts(len(self.tokens), self.seq_len, self.seed, self.node, self.num_nodes,
                                       position * self.batch_size, self.batch_size)
        return random_window_starts(len(self.tokens), self.seq_len, self.seed, self.node, position, self.batch_size)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.starts(self.position)
        self.position += 1
        return _window_batch(self.tokens, starts, self.seq_len)


def window_documents(tokens: Tokens, eos_id: int, seq_len: int, n_windows: int,
                     starts: Optional[np.ndarray] = None) -> list[int]:
    """For each of the first `n_windows` held-out windows (eval_batches' windows; or the windows at `starts`),
    the index of the document its first token belongs to (documents end with EOS): windows of one document
    are not independent, so standard errors are clustered by it (spes/eval/compare.py)."""
    tokens = as_sequence(tokens)
    starts = np.arange(n_windows) * seq_len if starts is None else np.asarray(starts)
    end = int(starts.max()) + 1 if len(starts) else 1
    eos = np.flatnonzero(np.asarray(tokens.read(0, min(len(tokens), end))) == eos_id)
    return np.searchsorted(eos, starts, side="left").tolist()  # EOS positions before the start = its document


def eval_window_starts(n_tokens: int, seq_len: int, count: Optional[int] = None, spread: bool = False) -> np.ndarray:
    """Start offsets of fixed, non-overlapping held-out windows: all of them (count None), the first `count`,
    or (spread) `count` of them evenly spaced over the whole split. Spread windows are a systematic sample:
    each document gets about its share of the split's windows, so their mean estimates the whole split's."""
    n_windows = (n_tokens - 1) // seq_len
    if n_windows == 0:
        raise DataError(f"held-out split has {n_tokens} tokens, fewer than one window of {seq_len + 1}")
    return _chosen(np.arange(n_windows) * seq_len, count, spread)


def _chosen(starts: np.ndarray, count: Optional[int], spread: bool) -> np.ndarray:
    if count is None or count >= len(starts):
        return starts
    return starts[np.arange(count) * len(starts) // count if spread else np.arange(count)]


def heldout_window_starts(tokens: Tokens, eos_id: int, seq_len: int, count: Optional[int] = None,
                          spread: bool = False, max_per_document: Optional[int] = None) -> np.ndarray:
    """eval_window_starts, with at most `max_per_document` windows of each document (the document of a window's
    first token; a longer document's kept windows evenly spaced over it) before the first/spread choice: no
    document holds more than that many of the scored windows, so a few long files cannot decide the mean."""
    tokens = as_sequence(tokens)
    every = eval_window_starts(len(tokens), seq_len)
    if max_per_document is None:
        return _chosen(every, count, spread)
    docs = np.asarray(window_documents(tokens, eos_id, seq_len, len(every), every))
    _, first, n = np.unique(docs, return_index=True, return_counts=True)  # docs ascend: each one a run
    keep = [f + np.arange(min(c, max_per_document)) * c // min(c, max_per_document) for f, c in zip(first, n)]
    return _chosen(every[np.concatenate(keep)], count, spread)


def eval_batches(tokens: Tokens, batch_size: int, seq_len: int, num_batches: Optional[int] = None,
                 spread: bool = False, starts: Optional[np.ndarray] = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, non-overlapping windows of the held-out split (same for every model): all of it (num_batches
    None), else `num_batches` batches of the first windows, or (spread) of windows evenly spaced over it; or
    the windows at `starts` (heldout_window_starts)."""
    tokens = as_sequence(tokens)
    if starts is None:
        starts = eval_window_starts(len(tokens), seq_len, None if num_batches is None else num_batches * batch_size,
                                    spread)
    for i in range(0, len(starts), batch_size):
        yield _window_batch(tokens, starts[i:i + batch_size], seq_len)
