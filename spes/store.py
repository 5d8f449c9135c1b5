"""The bundle format on shared storage (fsspec: a local folder or s3://), and safe, bounded storage calls.

A *bundle* is a folder of files + `manifest.json` (per file: sha256, bytes and, for safetensors, tensor
names, shapes, dtypes; plus free-form meta) + `COMMIT` (the manifest's sha256), written last with an
exclusive create. A bundle exists only once committed; readers verify every byte before parsing and
never unpickle. Raw-file bundles (token shards) hold files that are streamed, hashed and never parsed
(spes/file_bundles.py).

Every storage call goes through `Store._io`: bounded by `timeout_s` per attempt (S3), retried with
exponential backoff on transient errors (each retry logged), then `StoreUnavailable`. Paths are relative
to the store's root and may not leave it. Where things live is `spes/runs/layout.py`'s business.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import posixpath
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import fsspec
import torch
from safetensors.torch import load as st_load

FORMAT = "spes-bundle/1"
CHUNK = 8 << 20
log = logging.getLogger("spes.store")


class StoreError(RuntimeError):
    pass


class IntegrityError(StoreError):
    """A stored file does not match its manifest (truncated, altered or foreign)."""


class NotCommitted(StoreError):
    pass


class AlreadyCommitted(StoreError):
    pass


class StoreUnavailable(StoreError):
    """Storage did not answer within its timeout, retries included."""


class UnsafePath(StoreError):
    """A path that would leave the store's root."""


# Errors that say something definite about the data; never retried.
_DEFINITE = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError,
             StoreError, ValueError, TypeError, KeyError, AttributeError)


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@dataclass
class Bundle:
    manifest: dict[str, Any]
    files: dict[str, dict[str, torch.Tensor]]

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest["meta"]


class Store:
    def __init__(self, url: str, options: Optional[dict] = None, timeout_s: float = 30.0, retries: int = 4,
                 backoff_s: float = 0.5):
        opts = dict(options or {})
        protocol = url.split("://")[0] if "://" in url else "file"
        if protocol == "s3":
            # Listing caches would hide files other processes wrote: always go to storage. Bounded calls:
            # one attempt per call inside botocore/s3fs, our own (logged) retries around it.
            opts.setdefault("use_listings_cache", False)
            opts.setdefault("skip_instance_cache", True)
            ck = dict(opts.pop("config_kwargs", {}) or {})
            ck.setdefault("connect_timeout", timeout_s)
            ck.setdefault("read_timeout", timeout_s)
            ck.setdefault("retries", {"max_attempts": 1})
            opts["config_kwargs"] = ck
        self.fs, root = fsspec.core.url_to_fs(url, **opts)
        if protocol == "s3":
            self.fs.retries = 1  # s3fs's own silent retries (a class attribute); ours below log each one
        self.url, self.root, self.protocol = url, root.rstrip("/") or "/", protocol
        self.retries, self.backoff_s = retries, backoff_s
        self.bytes_read = self.bytes_written = 0  # every byte this Store moved (traffic reports)
        if protocol == "file":
            self.fs.makedirs(self.root, exist_ok=True)

    @classmethod
    def from_config(cls, storage) -> "Store":
        """From a `StorageConfig` section."""
        return cls(storage.url, storage.options, storage.timeout_s, storage.retries)

    # -- bounded, retried calls ------------------------------------------------------------------
    def _io(self, what: str, fn: Callable, *args, **kwargs):
        for attempt in range(self.retries + 1):
            try:
                return fn(*args, **kwargs)
            except _DEFINITE:
                raise
            except Exception as e:  # timeouts, refused or reset connections, 5xx: try again
                if attempt == self.retries:
                    raise StoreUnavailable(f"storage {self.url}: {what} failed after {attempt + 1} tries: "
                                           f"{type(e).__name__}: {e}") from None
                wait = self.backoff_s * 2 ** attempt
                log.warning("storage %s: %s failed (%s: %s); retry %d/%d in %.1fs", self.url, what,
                            type(e).__name__, e, attempt + 1, self.retries, wait)
                time.sleep(wait)

    # -- paths -----------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """Absolute storage path of `parts` (relative, '/'-separated); refuses anything leaving the root."""
        rel = "/".join(parts)
        segs = rel.split("/")
        if rel.startswith("/") or "\\" in rel or any(s in ("", ".", "..") for s in segs):
            raise UnsafePath(f"storage path {rel!r} is not a plain relative path under {self.url}")
        full = posixpath.normpath(posixpath.join(self.root, rel))
        if not (full + "/").startswith(self.root.rstrip("/") + "/"):
            raise UnsafePath(f"storage path {rel!r} leaves {self.url}")
        return full

    def exists(self, rel: str) -> bool:
        return self._io(f"exists {rel}", self.fs.exists, self.path(rel))

    def read_bytes(self, rel: str) -> bytes:
        data = self._io(f"read {rel}", self.fs.cat_file, self.path(rel))
        self.bytes_read += len(data)
        return data

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Replace `rel` with `data`, whole: readers see the old bytes or the new ones, never a torn mix
        (local files: a temp file renamed over it; S3: a PUT is atomic)."""
        if self.protocol == "file":
            self._io(f"write {rel}", self._local_replace, self.path(rel), data)
        else:
            self._io(f"write {rel}", self.fs.pipe_file, self.path(rel), data)
        self.bytes_written += len(data)

    @staticmethod
    def _local_tmp(p: str, data: bytes) -> str:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        tmp = f"{p}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        return tmp

    def _local_replace(self, p: str, data: bytes) -> None:
        os.replace(self._local_tmp(p, data), p)

    def _local_create(self, p: str, data: bytes) -> None:
        """Exclusive create with its full content at once: a hard link fails if `p` exists, and `p` never
        exists empty (an O_EXCL create would show an empty file until the write lands)."""
        tmp = self._local_tmp(p, data)
        try:
            os.link(tmp, p)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
                raise
            # a filesystem without hard links: O_EXCL, whose file shows empty until written (readers
            # of such files, the lease, look again)
            with open(p, "xb") as f:
                f.write(data)
        finally:
            os.unlink(tmp)

    def create_exclusive(self, rel: str, data: bytes) -> None:
        """Write `rel` only if it does not exist (FileExistsError otherwise): local O_EXCL, S3 If-None-Match.
        A retried create that finds its own bytes there (the first try landed) counts as done."""
        p = self.path(rel)
        self._io(f"makedirs {posixpath.dirname(rel)}", self.fs.makedirs, posixpath.dirname(p), exist_ok=True)
        for attempt in range(self.retries + 1):
            try:
                if self.protocol == "file":
                    self._local_create(p, data)
                else:
                    with self.fs.open(p, "xb") as f:
                        f.write(data)
                self.bytes_written += len(data)
                return
            except FileExistsError:
                if attempt > 0 and self._io(f"read {rel}", self.fs.cat_file, p) == data:
                    return
                raise
            except _DEFINITE:
                raise
            except Exception as e:
                if attempt == self.retries:
                    raise StoreUnavailable(f"storage {self.url}: create {rel} failed: {type(e).__name__}: {e}") from None
                log.warning("storage %s: create %s failed (%s); retry %d/%d", self.url, rel, e, attempt + 1,
                            self.retries)
                time.sleep(self.backoff_s * 2 ** attempt)

    def list_names(self, rel: str) -> list[str]:
        """Names directly under `rel` ([] if it does not exist)."""
        p = self.path(rel)
        try:
            entries = self._io(f"list {rel}", self.fs.ls, p, detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != p)

    def remove(self, rel: str) -> None:
        p = self.path(rel)
        if self.exists(rel):
            self._io(f"remove {rel}", self.fs.rm, p, recursive=True)

    def move(self, src: str, dst: str) -> None:
        self._io(f"move {src}", self.fs.mv, self.path(src), self.path(dst), recursive=True)

    def size_of(self, rel: str) -> int:
        """Bytes stored under `rel` (all files below it)."""
        p = self.path(rel)
        if not self.exists(rel):
            return 0
        sizes = self._io(f"du {rel}", self.fs.du, p, total=False)
        return int(sum(sizes.values())) if isinstance(sizes, dict) else int(sizes)

    # -- bundles ---------------------------------------------------------------------------------
    def is_committed(self, rel: str) -> bool:
        return self.exists(f"{rel}/COMMIT")

    def write_bundle(self, rel: str, files: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any]) -> dict:
        """Write safetensors files (tensors sorted by name), then the manifest, then COMMIT (exclusive).
        A leftover uncommitted attempt is replaced."""
        from spes.tensorio import BundleWriter

        bw = BundleWriter(self, rel)
        for fname, tensors in files.items():
            bw.add(fname, tensors)
        return bw.commit(meta)

    @contextlib.contextmanager
    def open_reader(self, rel: str, fname: str, entry: dict) -> Iterator["TensorReader"]:
        """Stream one safetensors file of a committed bundle tensor by tensor; verified when the block ends."""
        from spes.tensorio import TensorReader

        try:
            f = self._io(f"open {rel}/{fname}", self.fs.open, self.path(rel, fname), "rb")
        except FileNotFoundError:
            raise IntegrityError(f"{self.url}/{rel}/{fname} is missing") from None
        with f:
            reader = TensorReader(f, f"{self.url}/{rel}/{fname}", entry["sha256"], entry["bytes"])
            yield reader
            reader.finish()
            self.bytes_read += reader.n

    def start_bundle(self, rel: str) -> None:
        if self.is_committed(rel):
            raise AlreadyCommitted(f"{self.url}/{rel} is already committed")
        self.remove(rel)  # a crashed earlier attempt; never committed, so never read
        self._io(f"makedirs {rel}", self.fs.makedirs, self.path(rel), exist_ok=True)

    def commit_bundle(self, rel: str, entries: dict, meta: dict[str, Any]) -> dict:
        if not rel:
            raise UnsafePath("a bundle needs a path")
        manifest = {"format": FORMAT, "files": entries, "meta": meta, "written_at": time.time()}
        mbytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
        self.write_bytes(f"{rel}/manifest.json", mbytes)
        try:
            self.create_exclusive(f"{rel}/COMMIT", sha256_bytes(mbytes).encode())
        except FileExistsError:
            raise AlreadyCommitted(f"{self.url}/{rel} was committed concurrently by another writer") from None
        return manifest

    def read_manifest(self, rel: str) -> dict:
        try:
            want = self.read_bytes(f"{rel}/COMMIT").decode().strip()
        except FileNotFoundError:
            raise NotCommitted(f"{self.url}/{rel} is not committed") from None
        try:
            mbytes = self.read_bytes(f"{rel}/manifest.json")
        except FileNotFoundError:
            raise IntegrityError(f"{self.url}/{rel}/manifest.json is missing") from None
        if sha256_bytes(mbytes) != want:
            raise IntegrityError(f"{self.url}/{rel}/manifest.json does not match its COMMIT checksum")
        manifest = json.loads(mbytes)
        if manifest.get("format") != FORMAT:
            raise IntegrityError(f"{self.url}/{rel}/manifest.json: unknown format {manifest.get('format')!r}")
        return manifest

    def read_verified(self, rel: str, fname: str, entry: dict) -> bytes:
        """One file of a bundle, checked against its manifest entry (size and sha256)."""
        try:
            blob = self.read_bytes(f"{rel}/{fname}")
        except FileNotFoundError:
            raise IntegrityError(f"{self.url}/{rel}/{fname} is missing") from None
        if len(blob) != entry["bytes"] or sha256_bytes(blob) != entry["sha256"]:
            raise IntegrityError(f"{self.url}/{rel}/{fname}: sha256/size mismatch "
                                 f"({len(blob)} bytes, manifest says {entry['bytes']}); not loaded")
        return blob

    def read_bundle(self, rel: str, only: Optional[list[str]] = None, manifest: Optional[dict] = None) -> Bundle:
        """A committed bundle's safetensors files (`only` some of them), each verified against the manifest;
        pass a `manifest` already read (and verified) to read files without fetching it again."""
        manifest = manifest if manifest is not None else self.read_manifest(rel)
        files = {}
        for fname, entry in manifest["files"].items():
            if only is not None and fname not in only:
                continue
            if entry.get("raw"):
                raise IntegrityError(f"{self.url}/{rel}/{fname} is a raw file, not safetensors")
            tensors = st_load(self.read_verified(rel, fname, entry))
            declared = entry["tensors"]
            if set(tensors) != set(declared) or any(list(tensors[k].shape) != declared[k]["shape"] for k in tensors):
                raise IntegrityError(f"{self.url}/{rel}/{fname}: tensors differ from the manifest")
            files[fname] = tensors
        return Bundle(manifest, files)
