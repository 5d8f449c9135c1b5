"""The byte layer of shared storage (fsspec: a local folder or s3://): safe paths, bounded and retried calls,
whole-file writes, and counters of every call and byte.

Every call goes through one `RetryPolicy` (spes/storage/retry.py), streams included: on S3 a large file moves
part by part, each part retried alone (`writer`, `reader`: spes/storage/parts.py), so a dropped connection
costs one part; a stream that still fails surfaces as StoreUnavailable and the caller's unit of work, a
bundle, is redone whole.
Paths are relative to the store's root and may not leave it. What the files mean is the bundle format's
business (spes/storage/store.py).
"""
from __future__ import annotations

import copy
import os
import posixpath
from typing import BinaryIO, Callable, Optional, TypeVar, cast

import fsspec

from spes.errors import StorageError, UnsafePath
from spes.storage.atomic import atomic_create, atomic_write
from spes.storage.parts import PART_BYTES, PartUpload, RangedRead
from spes.storage.retry import RetryPolicy, is_access_denied

_S = TypeVar("_S", bound="FileStore")

class FileStore:
    def __init__(self, url: str, options: Optional[dict] = None, timeout_s: float = 30.0, retries: int = 4,
                 backoff_s: float = 0.5, part_bytes: int = PART_BYTES, role: str = ""):
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
        self.options = opts
        if protocol == "s3":
            self.fs.retries = 1  # s3fs's own silent retries (a class attribute); ours log each one
        self.url, self.root, self.protocol = url, root.rstrip("/") or "/", protocol
        self.policy = RetryPolicy(retries, backoff_s, where=f"storage {url}")
        self.bytes_read = self.bytes_written = 0  # every byte this store moved (traffic reports)
        self.calls = 0  # every storage call (tests bound the calls a round makes)
        self.part_bytes = part_bytes  # S3: what a dropped connection costs at most (spes/storage/parts.py)
        self.role = role
        """Whose work this store does ("orchestrator", "node machine"): named when storage refuses a call, since
        each role's key may do only what its policy allows (spes/run/access.py)."""
        if protocol == "file":
            self.fs.makedirs(self.root, exist_ok=True)
        self.real_root = os.path.realpath(self.root) if protocol == "file" else self.root

    @property
    def location(self) -> str:
        """Where this storage is, exactly, whatever the URL as written: the real absolute path of a local
        folder; scheme, endpoint, bucket and prefix on S3. Two copies of a repository with the same relative
        `storage.url` have different locations; per-machine state is keyed by this (spes/run/local_runs.py)."""
        if self.protocol == "file":
            return f"file://{self.real_root}"
        endpoint = (getattr(self.fs, "endpoint_url", None) or self.options.get("endpoint_url")
                    or (self.options.get("client_kwargs") or {}).get("endpoint_url")
                    or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "aws")
        return f"{self.protocol}://{str(endpoint).rstrip('/')}/{self.root.strip('/')}"

    def counted_apart(self: _S) -> _S:
        """The same storage, connection shared, with byte and call counters of its own: for work on another
        thread whose traffic is reported apart (a prefetch beside a round's own reads)."""
        twin = copy.copy(self)
        twin.bytes_read = twin.bytes_written = twin.calls = 0
        return twin

    @classmethod
    def from_config(cls: type[_S], storage, role: str = "") -> _S:
        """From a `StorageConfig` section (a Store's from_config gives a Store)."""
        return cls(storage.url, storage.options, storage.timeout_s, storage.retries, role=role)

    @property
    def retries(self) -> int:
        return self.policy.retries

    def _io(self, what: str, fn: Callable, *args, **kwargs):
        self.calls += 1
        try:
            return self.policy.call(what, fn, *args, **kwargs)
        except Exception as e:
            if is_access_denied(e):
                raise self._access_error(what, e) from None
            if self.protocol == "s3" and isinstance(e, FileNotFoundError) and "bucket does not exist" in str(e):
                raise StorageError(f"storage {self.url}: {what}: the bucket {self.root.split('/', 1)[0]!r} does not "
                                   "exist at that endpoint; create it first (nothing here creates buckets)") from None
            raise

    def _access_error(self, what: str, e: BaseException) -> StorageError:
        """Denied, or no credentials: one line naming where, not a traceback (it cannot change on a retry)."""
        where = self.url
        endpoint = (self.options.get("endpoint_url") or (self.options.get("client_kwargs") or {}).get("endpoint_url"))
        key = f"the {self.role}'s key" if self.role else "this machine's key"
        if self.protocol == "s3":
            where = f"bucket {self.root.split('/', 1)[0]!r} ({self.url}) at {endpoint or 'the default AWS endpoint'}"
            hint = ("; check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE) on this machine"
                    " and that key's policy (`python -m spes.policy` prints what each role may do)")
        else:
            hint = "; check the folder's permissions"
        return StorageError(f"storage {where}: {what}: access denied to {key} ({type(e).__name__}: {e}){hint}")

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
        if self.protocol == "file":  # a symbolic link below the root must not lead out of it
            real = os.path.realpath(full)
            if not (real + "/").startswith(self.real_root.rstrip("/") + "/"):
                raise UnsafePath(f"storage path {rel!r} resolves to {real}, outside the storage root "
                                 f"{self.real_root} (a symbolic link out of it); refusing to read or write it")
        return full

    # -- calls -----------------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        return self._io(f"exists {rel}", self.fs.exists, self.path(rel))

    def read_bytes(self, rel: str, size: Optional[int] = None) -> bytes:
        """The whole file; `size` (as a manifest gives it): a large file on S3 is read part by part."""
        if size is not None and self.protocol == "s3" and size > self.part_bytes:
            with self.reader(rel, size) as f:
                data = f.read()
        else:
            data = self._io(f"read {rel}", self.fs.cat_file, self.path(rel))
        self.bytes_read += len(data)
        return data

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Replace `rel` with `data`, whole: readers see the old bytes or the new ones, never a torn mix
        (local files: an fsynced temp file renamed over it; S3: a PUT is atomic)."""
        if self.protocol == "file":
            self._io(f"write {rel}", atomic_write, self.path(rel), data)
        else:
            self._io(f"write {rel}", self.fs.pipe_file, self.path(rel), data)
        self.bytes_written += len(data)

    def create_exclusive(self, rel: str, data: bytes) -> None:
        """Write `rel` only if it does not exist (FileExistsError otherwise): local hard link, S3 If-None-Match.
        A retried create that finds its own bytes there (the first try landed) counts as done."""
        p = self.path(rel)
        self.makedirs(posixpath.dirname(rel))
        tries = 0

        def create() -> None:
            nonlocal tries
            tries += 1
            try:
                if self.protocol == "file":
                    atomic_create(p, data)
                else:
                    with self.fs.open(p, "xb") as f:
                        f.write(data)
            except FileExistsError:
                if tries == 1 or self.fs.cat_file(p) != data:
                    raise

        self._io(f"create {rel}", create)
        self.bytes_written += len(data)

    def open(self, rel: str, mode: str) -> BinaryIO:
        """A file object for streaming ('rb' or 'wb'); opening it goes through the retry policy."""
        return self._io(f"open {rel}", self.fs.open, self.path(rel), mode)

    def writer(self, rel: str) -> BinaryIO:
        """A file object writing `rel` whole: on S3 a multipart upload, each part a retried call of its own and
        nothing visible unless it completes (spes/storage/parts.py); elsewhere the plain file, which the
        caller opens and writes under one retried call (`_io`)."""
        if self.protocol != "s3":
            return self.fs.open(self.path(rel), "wb")
        return cast(BinaryIO, PartUpload(self.fs, self.path(rel), self.policy, f"write {rel}", self.part_bytes,
                                         self._count_call))

    def reader(self, rel: str, size: int) -> BinaryIO:
        """A file object reading `rel` (`size` bytes, as its manifest says): on S3 a file over one part as
        ranged reads, each a retried call of its own; elsewhere the plain file (opened under the caller's
        retried call)."""
        if self.protocol != "s3" or size <= self.part_bytes:
            return self.fs.open(self.path(rel), "rb")
        return cast(BinaryIO, RangedRead(self.fs, self.path(rel), size, self.policy, f"read {rel}", self.part_bytes,
                                         self._count_call))

    def _count_call(self) -> None:
        self.calls += 1

    def makedirs(self, rel: str) -> None:
        """A local folder; nothing on S3, which has no folders (s3fs would probe the bucket, and try to create
        it, with calls a node's key may not make: spes/run/access.py)."""
        if self.protocol != "s3":
            self._io(f"makedirs {rel}", self.fs.makedirs, self.path(rel), exist_ok=True)

    def list_names(self, rel: str) -> list[str]:
        """Names directly under `rel` ([] if it does not exist)."""
        p = self.path(rel)
        try:
            entries = self._io(f"list {rel}", self.fs.ls, p, detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != p)

    def remove(self, rel: str) -> None:
        """Remove the folder `rel` (a bundle) and all below it; nothing if there is none. On S3 only the objects
        listed under `rel/` are deleted, never the bare name probed: a node's key may touch only what lies below
        its own folders (spes/run/access.py). A single file: `remove_file`."""
        p = self.path(rel)
        if self.protocol == "s3":
            # one DELETE per object, markers first (no half-removed bundle counts as committed): s3fs's bulk
            # delete drops the errors S3 reports per key, so a refused delete would pass unseen
            for obj in sorted(self._objects_under(rel), key=lambda o: posixpath.basename(o) not in self.MARKERS):
                self._io(f"remove {posixpath.relpath(obj, self.root)}", self.fs.rm_file, obj)
            return
        try:
            self._io(f"remove {rel}", self.fs.rm, p, recursive=True)
        except FileNotFoundError:
            pass

    def remove_file(self, rel: str) -> None:
        """Remove the file `rel`; nothing if there is none."""
        try:
            self._io(f"remove {rel}", self.fs.rm_file, self.path(rel))
        except FileNotFoundError:
            pass

    def _objects_under(self, rel: str) -> list[str]:
        """S3: every object whose key starts with `rel/`, by one listing of that prefix (s3fs's find of a
        path also probes the path's own name when nothing is below it)."""
        parent, name = posixpath.split(self.path(rel))
        return sorted(self._io(f"list {rel}", self.fs.find, parent, prefix=name + "/"))

    MARKERS: tuple[str, ...] = ()
    """File names that make a folder count (a bundle's COMMIT): an object-store move copies them last and
    deletes them first, so no half-moved folder is ever read as complete, at either end."""

    def move(self, src: str, dst: str) -> None:
        """Move the file or folder `src` to `dst`. A local folder is renamed at once. An object store has no
        folders (s3fs's recursive mv asks for folder keys S3 does not have): each listed object is copied, then
        the originals deleted, markers copied last and deleted first. Interrupted and retried, it finishes:
        what is already copied is copied again, what is already deleted is not listed."""
        if self.protocol == "file":
            self._io(f"move {src}", self.fs.mv, self.path(src), self.path(dst), recursive=True)
            return
        root = self.path(src)
        found = self._io(f"list {src}", self.fs.find, root)
        objs = sorted((f.rstrip("/") for f in found), key=lambda f: posixpath.basename(f) in self.MARKERS)
        if not objs:
            return
        for obj in objs:  # markers at the end: a destination bundle is committed only once whole
            rel = posixpath.relpath(obj, root)
            target = self.path(dst) if rel == "." else self.path(dst, rel)
            self._io(f"copy {obj}", self.fs.copy, obj, target)
        for obj in objs[::-1]:  # markers first: the source stops counting as committed before it thins out
            try:
                self._io(f"delete {obj}", self.fs.rm_file, obj)
            except FileNotFoundError:
                pass

    def size_of(self, rel: str) -> int:
        """Bytes stored under `rel` (all files below it)."""
        p = self.path(rel)
        if not self.exists(rel):
            return 0
        sizes = self._io(f"du {rel}", self.fs.du, p, total=False)
        return int(sum(sizes.values())) if isinstance(sizes, dict) else int(sizes)
