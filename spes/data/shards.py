"""Token shards on disk: bounded-size files of raw token ids, read back as one memory-mapped sequence.

A split (train, val) is a list of shards `<split>-<k:06d>.bin` (uint16, or uint32 for vocabularies over
65,536 ids; documents joined by EOS) described in the folder's index (`meta.json`, spes/data/tokens.py): per
shard its file name, tokens, documents and sha256. A shard is written under a `.part` name and renamed
once complete, so no half-written shard is ever visible under its final name.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, BinaryIO, Optional

import numpy as np

from spes.errors import ConfigError


class ShardWriter:
    """Append token arrays to a split; a new shard starts when the current one holds `shard_tokens`.
    Documents never straddle two shards unless one document alone is larger than a shard."""

    def __init__(self, folder: str, split: str, dtype: np.dtype, shard_tokens: int):
        if shard_tokens < 1:
            raise ConfigError(f"shard_tokens must be >= 1, got {shard_tokens}")
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self._f: Optional[BinaryIO] = None
        self._h: Any = None  # hashlib's sha256 of the open shard
        self._tokens = self._docs = 0

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):06d}.bin"
        self._name, self._f, self._h = name, open(os.path.join(self.folder, name + ".part"), "wb"), hashlib.sha256()
        self._tokens = self._docs = 0

    def _close(self) -> None:
        assert self._f is not None
        self._f.close()
        os.replace(os.path.join(self.folder, self._name + ".part"), os.path.join(self.folder, self._name))
        self.shards.append({"file": self._name, "tokens": self._tokens, "documents": self._docs,
                            "sha256": self._h.hexdigest()})
        self._f = None

    def add(self, tokens: np.ndarray, doc_ends: np.ndarray) -> None:
        """Append whole documents: `tokens` (EOS included), `doc_ends` the end offset of each document in it."""
        start, first = 0, 0
        while first < len(doc_ends):
            if self._f is None:
                self._open()
            room = self.shard_tokens - self._tokens
            # the documents that still fit; at least one in an empty shard (a document larger than a shard)
            last = int(np.searchsorted(doc_ends, start + room, side="right"))
            if last == first:
                if self._tokens:
                    self._close()
                    continue
                last = first + 1
            end = int(doc_ends[last - 1])
            buf = np.ascontiguousarray(tokens[start:end], dtype=self.dtype).tobytes()
            assert self._f is not None
            self._f.write(buf)
            self._h.update(buf)
            self._tokens += end - start
            self._docs += last - first
            start, first = end, last
            if self._tokens >= self.shard_tokens:
                self._close()

    def finish(self) -> list[dict]:
        if self._f is not None:
            self._close()
        return self.shards

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            os.remove(os.path.join(self.folder, self._name + ".part"))
            self._f = None


class TokenSequence:
    """The shards of one split as one sequence of token ids (each shard memory-mapped, nothing loaded)."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = [a for a in arrays if len(a)]
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])
        self.dtype = arrays[0].dtype if arrays else np.dtype(np.uint16)

    @classmethod
    def open(cls, folder: str, shards: list[dict], dtype: np.dtype) -> "TokenSequence":
        return cls([np.memmap(os.path.join(folder, s["file"]), dtype=dtype, mode="r") if s["tokens"] else
                    np.zeros(0, dtype=dtype) for s in shards])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """tokens[start:start+length], across shard boundaries if need be."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) outside a sequence of {len(self)}")
        k = int(np.searchsorted(self.offsets, start, side="right")) - 1
        lo = start - int(self.offsets[k])
        if lo + length <= len(self.arrays[k]):
            return np.asarray(self.arrays[k][lo:lo + length])
        parts, left = [], length
        while left > 0:
            piece = self.arrays[k][lo:lo + left]
            parts.append(np.asarray(piece))
            left -= len(piece)
            k, lo = k + 1, 0
        return np.concatenate(parts)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """A (len(starts), length) int64 array of the windows at `starts`."""
        if len(self.arrays) == 1:  # one shard: one fancy-indexing read
            idx = np.asarray(starts)[:, None] + np.arange(length)[None, :]
            return self.arrays[0][idx].astype(np.int64)
        return np.stack([self.read(int(s), length) for s in starts]).astype(np.int64)

    def __array__(self, dtype: Optional[np.dtype] = None, copy=None) -> np.ndarray:
        """The whole sequence in memory (tests and small splits only)."""
        out = np.concatenate([np.asarray(a) for a in self.arrays]) if self.arrays else np.zeros(0, self.dtype)
        return out.astype(dtype) if dtype is not None else out
