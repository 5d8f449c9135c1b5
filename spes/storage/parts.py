"""Large files on S3 moved part by part, each part retried alone: a connection that drops in the middle of a
bundle costs the part in flight, not the file (over a slow link, minutes of a round).

    PartUpload   a write as an S3 multipart upload: parts of `part_bytes` (S3's minimum is 5 MiB), each sent
                 under the store's retry policy; a file smaller than one part is one PUT; an upload that fails
                 is aborted, so nothing partial is ever visible (S3 shows an object only once it completes)
    RangedRead   a read as ranged GETs of `part_bytes`, each retried alone, for a file of known size

Local folders need neither: a local write or read does not drop halfway.
"""
from __future__ import annotations

import errno
import io
from typing import Any, Callable, Optional

from spes.storage.retry import RetryPolicy

PART_BYTES = 8 * 2**20
"""Bytes per part: above S3's 5 MiB minimum, small enough that a retried part costs seconds on a slow link."""


class PartUpload(io.RawIOBase):
    def __init__(self, fs: Any, path: str, policy: RetryPolicy, what: str, part_bytes: int = PART_BYTES,
                 on_request: Optional[Callable[[], None]] = None):
        self.fs, self.path, self.policy, self.what, self.part_bytes = fs, path, policy, what, part_bytes
        self.bucket, self.key, _ = fs.split_path(path)
        self.on_request = on_request or (lambda: None)
        self.buf = bytearray()
        self.upload_id: Optional[str] = None
        self.parts: list[dict] = []
        self.total = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        self.buf += view
        self.total += view.nbytes
        while len(self.buf) >= self.part_bytes:
            self._send(bytes(self.buf[:self.part_bytes]))
            del self.buf[:self.part_bytes]
        return view.nbytes

    def _call(self, what: str, method: str, **kw) -> dict:
        self.on_request()
        return self.policy.call(f"{self.what}: {what}", self.fs.call_s3, method, Bucket=self.bucket, Key=self.key, **kw)

    def _send(self, data: bytes) -> None:
        if self.upload_id is None:
            self.upload_id = self._call("start", "create_multipart_upload")["UploadId"]
        n = len(self.parts) + 1
        out = self._call(f"part {n}", "upload_part", UploadId=self.upload_id, PartNumber=n, Body=data)
        self.parts.append({"PartNumber": n, "ETag": out["ETag"]})

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self.upload_id is None:  # smaller than a part: one PUT
                self.on_request()
                self.policy.call(self.what, self.fs.pipe_file, self.path, bytes(self.buf))
            else:
                if self.buf:
                    self._send(bytes(self.buf))
                self._call("complete", "complete_multipart_upload", UploadId=self.upload_id,
                           MultipartUpload={"Parts": self.parts})
            self.fs.invalidate_cache(self.path)
        finally:
            self.buf = bytearray()
            super().close()

    def abort(self) -> None:
        """Give up: the parts sent are dropped by S3, no object appears."""
        if self.upload_id is not None:
            try:
                self._call("abort", "abort_multipart_upload", UploadId=self.upload_id)
            except Exception:  # unreachable storage: S3's lifecycle rules clear unfinished uploads
                pass
        self.buf = bytearray()
        super().close()

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            self.abort()
        else:
            self.close()

    def __del__(self) -> None:
        """Never complete an upload nobody closed (IOBase would): unfinished, it stays invisible."""


class RangedRead(io.RawIOBase):
    """Reads at most `size` + 1 bytes: one past the size its manifest gives, so a longer file fails the
    caller's size check rather than passing as its first `size` bytes."""

    def __init__(self, fs: Any, path: str, size: int, policy: RetryPolicy, what: str, part_bytes: int = PART_BYTES,
                 on_request: Optional[Callable[[], None]] = None):
        self.fs, self.path, self.size, self.policy, self.what = fs, path, size, policy, what
        self.part_bytes, self.on_request = part_bytes, on_request or (lambda: None)
        self.pos, self.eof = 0, False
        self.chunk, self.chunk_start = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if not self.chunk_start <= self.pos < self.chunk_start + len(self.chunk):
            if self.eof or self.pos > self.size:
                return 0
            end = self.pos + self.part_bytes
            end = self.size + 1 if end >= self.size else end  # the last range asks for one byte more
            self.on_request()
            self.chunk = self.policy.call(f"{self.what}: bytes {self.pos}-{end}", self._range, self.pos, end)
            self.chunk_start = self.pos
            self.eof = len(self.chunk) < end - self.pos
            if not self.chunk:
                return 0
        off = self.pos - self.chunk_start
        n = min(len(b), len(self.chunk) - off)
        b[:n] = self.chunk[off:off + n]
        self.pos += n
        return n

    def _range(self, start: int, end: int) -> bytes:
        """Bytes start..end; none past the object's end. A range that starts past it (an object shorter than
        its manifest by whole parts) is answered 416 and reads as the end of the file, so the caller's size
        check names the file, as for any other short file."""
        try:
            return self.fs.cat_file(self.path, start=start, end=end)
        except OSError as e:
            if e.errno == errno.EINVAL and "range" in str(e).lower():
                return b""
            raise

    def readall(self) -> bytes:
        out, buf = [], bytearray(self.part_bytes)
        while n := self.readinto(buf):  # a part per call
            out.append(bytes(buf[:n]))
        return b"".join(out)
