"""The bundle format on shared storage, on top of the byte layer (spes/storage/files.py).

A *bundle* is a folder of files + `manifest.json` (per file: sha256, bytes and, for safetensors, tensor
names, shapes, dtypes; plus free-form meta) + `COMMIT` (the manifest's sha256), written last with an
exclusive create. A bundle exists only once committed; readers verify every byte before parsing and
never unpickle. Raw-file bundles (token shards) hold files that are streamed, hashed and never parsed
(spes/storage/file_bundles.py). Where things live is `spes/run/layout.py`'s business.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from safetensors.torch import load as st_load

from spes.errors import AlreadyCommitted, IntegrityError, NotCommitted, UnsafePath
from spes.storage.files import FileStore
from spes.storage.tensorio import TensorReader, TensorWriter, spec_of, write_tensors

FORMAT = "spes-bundle/1"
CHUNK = 8 << 20


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@dataclass
class Bundle:
    manifest: dict[str, Any]
    files: dict[str, dict[str, torch.Tensor]]

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest["meta"]


def _check_manifest(manifest: Any, where: str) -> dict:
    """The manifest's shape, checked before anything reads a field of it."""
    if not isinstance(manifest, dict):
        raise IntegrityError(f"{where}: not a manifest (a JSON object expected)")
    if manifest.get("format") != FORMAT:
        raise IntegrityError(f"{where}: unknown format {manifest.get('format')!r}")
    files, meta = manifest.get("files"), manifest.get("meta")
    if not isinstance(files, dict) or not isinstance(meta, dict):
        raise IntegrityError(f"{where}: 'files' and 'meta' must be JSON objects")
    for fname, e in files.items():
        if not isinstance(e, dict) or not isinstance(e.get("sha256"), str) or not isinstance(e.get("bytes"), int):
            raise IntegrityError(f"{where}: entry {fname!r} lacks sha256/bytes")
        if "/" in fname or fname in ("", ".", "..", "COMMIT", "manifest.json"):
            raise IntegrityError(f"{where}: refusing file name {fname!r}")
    return manifest


class Store(FileStore):
    """Shared storage with bundles: write (whole or streamed), commit, read verified."""

    MARKERS = ("COMMIT",)

    def is_committed(self, rel: str) -> bool:
        return self.exists(f"{rel}/COMMIT")

    def write_bundle(self, rel: str, files: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any]) -> dict:
        """Write safetensors files (tensors sorted by name), then the manifest, then COMMIT (exclusive).
        A leftover uncommitted attempt is replaced."""
        bw = BundleWriter(self, rel)
        for fname, tensors in files.items():
            bw.add(fname, tensors)
        return bw.commit(meta)

    @contextlib.contextmanager
    def open_reader(self, rel: str, fname: str, entry: dict) -> Iterator[TensorReader]:
        """Stream one safetensors file of a committed bundle tensor by tensor; verified when the block ends."""
        missing = IntegrityError(f"{self.url}/{rel}/{fname} is missing")
        try:
            f = self._io(f"open {rel}/{fname}", self.reader, f"{rel}/{fname}", entry["bytes"])
        except FileNotFoundError:
            raise missing from None
        with f:
            try:
                reader = TensorReader(f, f"{self.url}/{rel}/{fname}", entry["sha256"], entry["bytes"])
            except FileNotFoundError:  # a ranged read (S3) finds the file gone at its first range
                raise missing from None
            yield reader
            reader.finish()
            self.bytes_read += reader.n

    def start_bundle(self, rel: str) -> None:
        if self.is_committed(rel):
            raise AlreadyCommitted(f"{self.url}/{rel} is already committed")
        self.remove(rel)  # a crashed earlier attempt; never committed, so never read
        self.makedirs(rel)

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

    def read_manifest(self, rel: str, held: Optional[tuple[str, dict]] = None) -> dict:
        """The committed manifest of bundle `rel`. `held` = (mark, manifest) read before (`read_marked`): taken
        when the COMMIT marker still names it (one small read instead of the manifest's)."""
        return self.read_marked(rel, held)[1]

    def read_marked(self, rel: str, held: Optional[tuple[str, dict]] = None) -> tuple[str, dict]:
        """(the COMMIT marker: the manifest's sha256, the manifest)."""
        where = f"{self.url}/{rel}/manifest.json"
        try:
            want = self.read_bytes(f"{rel}/COMMIT").decode(errors="replace").strip()
        except FileNotFoundError:
            raise NotCommitted(f"{self.url}/{rel} is not committed") from None
        if held is not None and held[0] == want:
            return held
        try:
            mbytes = self.read_bytes(f"{rel}/manifest.json")
        except FileNotFoundError:
            raise IntegrityError(f"{where} is missing") from None
        if sha256_bytes(mbytes) != want:
            raise IntegrityError(f"{where} does not match its COMMIT checksum")
        try:
            manifest = json.loads(mbytes)
        except (ValueError, UnicodeDecodeError) as e:
            raise IntegrityError(f"{where}: not JSON ({e})") from None
        return want, _check_manifest(manifest, where)

    def read_verified(self, rel: str, fname: str, entry: dict) -> bytes:
        """One file of a bundle, checked against its manifest entry (size and sha256)."""
        try:
            blob = self.read_bytes(f"{rel}/{fname}", entry["bytes"])
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
            where = f"{self.url}/{rel}/{fname}"
            if entry.get("raw"):
                raise IntegrityError(f"{where} is a raw file, not safetensors")
            blob = self.read_verified(rel, fname, entry)
            if blob[:1] == b"\x80" and blob[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
                raise IntegrityError(f"{where}: a Python pickle, not safetensors: never loaded; nothing of this "
                                     "system writes one, so storage holds a file it did not write")
            try:
                tensors = st_load(blob)
            except IntegrityError:
                raise
            except Exception as e:  # bytes that match the manifest but are no safetensors file
                raise IntegrityError(f"{where}: not a safetensors file ({type(e).__name__}: {e})") from None
            declared = entry.get("tensors")
            if not isinstance(declared, dict) or set(tensors) != set(declared) or \
                    any(list(tensors[k].shape) != declared[k].get("shape") for k in tensors):
                raise IntegrityError(f"{where}: tensors differ from the manifest")
            files[fname] = tensors
        return Bundle(manifest, files)


def _tensor_entry(specs, sha: str, n: int) -> dict:
    return {"sha256": sha, "bytes": n,
            "tensors": {name: {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
                        for name, dtype, shape in specs}}


class BundleWriter:
    """Builds one bundle file by file (small files at once, big ones streamed tensor by tensor), then commits.

        bw = BundleWriter(store, rel)
        bw.add("small.safetensors", tensors)
        with bw.stream("big.safetensors", specs) as w:   # spes.storage.tensorio.TensorWriter
            for name, ... : w.write(name, tensor)
        bw.commit(meta)
    """

    def __init__(self, store: Store, rel: str):
        self.store, self.rel = store, rel
        self.entries: dict[str, dict] = {}
        store.start_bundle(rel)

    def add(self, fname: str, tensors: dict[str, torch.Tensor]) -> dict:
        def write():
            with self.store.writer(f"{self.rel}/{fname}") as f:
                return write_tensors(f, tensors)

        sha, n = self.store._io(f"write {self.rel}/{fname}", write)
        self.store.bytes_written += n
        self.entries[fname] = _tensor_entry([spec_of(k, tensors[k]) for k in sorted(tensors)], sha, n)
        return self.entries[fname]

    @contextlib.contextmanager
    def stream(self, fname: str, specs) -> Iterator[TensorWriter]:
        specs = list(specs)
        with self.store._io(f"open {self.rel}/{fname}", self.store.writer, f"{self.rel}/{fname}") as f:
            w = TensorWriter(f, specs)
            yield w
            sha, n = w.close()
        self.store.bytes_written += n
        self.entries[fname] = _tensor_entry(specs, sha, n)

    def commit(self, meta: dict[str, Any]) -> dict:
        return self.store.commit_bundle(self.rel, self.entries, meta)
