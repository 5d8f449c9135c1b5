"""Streaming safetensors: write and read a file tensor by tensor, hashing every byte on the way.

The round files (global models, deltas, uploads) can be larger than what one wants in memory several times
over; these let the aggregator hold one tensor per input at a time. Files are plain safetensors (the
`safetensors` package loads them), with tensors in the order given (sorted by name, by convention) and
a header padded to 8 bytes. The same tensors always give the same bytes, so a node that rebuilds a
global model locally can compare its file's sha256 with the committed one. `BundleWriter` (spes/storage/store.py)
writes a bundle file by file with these.
"""
from __future__ import annotations

import hashlib
import json
import queue
import struct
import threading
from typing import Any, BinaryIO, Iterable, Optional

import torch

from spes.errors import IntegrityError, WriterMisuse

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int8: "I8", torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}

Spec = tuple[str, torch.dtype, tuple[int, ...]]


def spec_of(name: str, t: torch.Tensor) -> Spec:
    return name, t.dtype, tuple(t.shape)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


class BackgroundSha256:
    """sha256 computed on a helper thread (hashlib releases the GIL), so hashing overlaps the caller's
    reads, writes and arithmetic. Buffers must not change after `update`; at most `depth` wait."""

    _STOP = object()

    def __init__(self, depth: int = 4):
        self._h = hashlib.sha256()
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while (buf := self._q.get()) is not self._STOP:
            self._h.update(buf)

    def update(self, buf) -> None:
        self._q.put(buf)

    def hexdigest(self) -> str:
        if self._t.is_alive():
            self._q.put(self._STOP)
            self._t.join()
        return self._h.hexdigest()


def _raw(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a buffer


def file_bytes(specs: Iterable[Spec]) -> int:
    """The size of the safetensors file TensorWriter writes for `specs` (header, padding, data)."""
    header, off = {}, 0
    for name, dtype, shape in specs:
        end = off + _nbytes(dtype, shape)
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [off, end]}
        off = end
    hb = len(json.dumps(header, separators=(",", ":")).encode())
    return 8 + hb + (-hb % 8) + off


class TensorWriter:
    """Header first (all specs known up front), then each tensor in spec order; `close()` -> (sha256, bytes)."""

    def __init__(self, f: BinaryIO, specs: Iterable[Spec]):
        self.f, self.specs, self.h, self.n, self.i = f, list(specs), BackgroundSha256(), 0, 0
        header, off = {}, 0
        for name, dtype, shape in self.specs:
            end = off + _nbytes(dtype, shape)
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [off, end]}
            off = end
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        self._put(struct.pack("<Q", len(hb)) + hb)

    def _put(self, b) -> None:
        self.f.write(b)
        self.h.update(b)
        self.n += len(b)

    def write(self, name: str, t: torch.Tensor) -> None:
        want = self.specs[self.i]
        if spec_of(name, t) != want:
            raise WriterMisuse(f"tensor writer: got {spec_of(name, t)}, expected {want} next")
        self._put(_raw(t))
        self.i += 1

    def close(self) -> tuple[str, int]:
        if self.i != len(self.specs):
            raise WriterMisuse(f"tensor writer: {len(self.specs) - self.i} tensors not written")
        return self.h.hexdigest(), self.n


class TensorReader:
    """Reads tensors in file order, hashing as it goes; `finish()` checks size and sha256 against the manifest."""

    def __init__(self, f: BinaryIO, where: str, sha256: Optional[str] = None, nbytes: Optional[int] = None):
        self.f, self.where, self.want_sha, self.want_n = f, where, sha256, nbytes
        self.h, self.n = BackgroundSha256(), 0
        (hlen,) = struct.unpack("<Q", self._take(8))
        if nbytes is not None and hlen > nbytes:
            raise IntegrityError(f"{where}: header length {hlen} exceeds the file's {nbytes} bytes")
        try:
            header = json.loads(bytes(self._take(hlen)))
        except ValueError:
            raise IntegrityError(f"{where}: unreadable safetensors header") from None
        header.pop("__metadata__", None)
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        self.order = [name for name, _ in entries]
        self.entries = dict(entries)
        self.pos = 0  # offset in the data section

    def _take(self, n: int) -> bytearray:
        buf = bytearray(n)
        f: Any = self.f  # a binary file object: local, fsspec or S3 (all have readinto)
        got = f.readinto(memoryview(buf)) if n else 0
        while got < n:  # short reads from buffered remote files
            more = f.readinto(memoryview(buf)[got:])
            if not more:
                raise IntegrityError(f"{self.where}: truncated ({self.n + got} bytes, wanted more)")
            got += more
        self.h.update(buf)
        self.n += n
        return buf


    def read(self, name: str) -> torch.Tensor:
        """The next tensor, which must be `name` (tensors are consumed in file order)."""
        e = self.entries.get(name)
        if e is None:
            raise IntegrityError(f"{self.where}: no tensor {name!r}")
        begin, end = e["data_offsets"]
        if begin != self.pos:
            raise IntegrityError(f"{self.where}: {name!r} is not the next tensor in the file")
        buf = self._take(end - begin)
        self.pos = end
        dtype = TORCH_DTYPES[e["dtype"]]
        t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        return t.reshape(e["shape"])

    def finish(self) -> None:
        rest = self.f.read()
        if rest:
            self.h.update(rest)
            self.n += len(rest)
        if (self.want_n is not None and self.n != self.want_n) or (self.want_sha and self.h.hexdigest() != self.want_sha):
            raise IntegrityError(f"{self.where}: sha256/size mismatch ({self.n} bytes, manifest says {self.want_n}); "
                                 "not used")

    def read_all(self) -> dict[str, torch.Tensor]:
        out = {name: self.read(name) for name in list(self.order)}
        self.finish()
        return out


def write_tensors(f: BinaryIO, tensors: dict[str, torch.Tensor]) -> tuple[str, int]:
    """All of `tensors`, sorted by name."""
    w = TensorWriter(f, [spec_of(n, tensors[n]) for n in sorted(tensors)])
    for n in sorted(tensors):
        w.write(n, tensors[n])
    return w.close()


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """The sha256 `write_tensors` would give, without writing anything."""
    class _Null:
        def write(self, b):
            return len(b)

    return write_tensors(_Null(), tensors)[0]  # type: ignore[arg-type]
