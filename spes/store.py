"""Artifact store on shared storage (fsspec: a local folder or s3://).

A *bundle* is a folder of safetensors files + `manifest.json` (per file: sha256, bytes, tensor names,
shapes, dtypes; plus free-form meta) + `COMMIT` (the manifest's sha256), written last with an exclusive
create. A bundle exists only once committed; readers verify every byte before parsing and never unpickle.

Layout:  runs/<run>/LOCK.json
         runs/<run>/rounds/<r:06d>/global/        aggregated model (+ DiLoCo outer state)
         runs/<run>/rounds/<r:06d>/nodes/<i:03d>/  node upload + optimizer state + data position
         data/tokens/<sha>/                         token shards for nodes on other machines (raw files)
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import fsspec
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT = "spes-bundle/1"
_CHUNK = 8 << 20


class StoreError(RuntimeError):
    pass


class IntegrityError(StoreError):
    """A stored file does not match its manifest (truncated, altered or foreign)."""


class NotCommitted(StoreError):
    pass


class AlreadyCommitted(StoreError):
    pass


class RunLocked(StoreError):
    pass


def _sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@dataclass
class Bundle:
    manifest: dict[str, Any]
    files: dict[str, dict[str, torch.Tensor]]

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest["meta"]


class Store:
    def __init__(self, url: str, options: Optional[dict] = None):
        # Listing caches would hide files other processes wrote: always go to storage.
        opts = dict(options or {})
        protocol = url.split("://")[0] if "://" in url else "file"
        if protocol == "s3":
            opts.setdefault("use_listings_cache", False)
            opts.setdefault("skip_instance_cache", True)
        self.fs, root = fsspec.core.url_to_fs(url, **opts)
        self.url, self.root, self.protocol = url, root.rstrip("/"), protocol
        if protocol == "file":
            self.fs.makedirs(self.root, exist_ok=True)

    # -- paths -----------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    @staticmethod
    def round_dir(run: str, r: int) -> str:
        return f"runs/{run}/rounds/{r:06d}"

    def global_dir(self, run: str, r: int) -> str:
        return f"{self.round_dir(run, r)}/global"

    def node_dir(self, run: str, r: int, node: int) -> str:
        return f"{self.round_dir(run, r)}/nodes/{node:03d}"

    # -- bundles ---------------------------------------------------------------------------------
    def is_committed(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel, "COMMIT"))

    def write_bundle(self, rel: str, files: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any]) -> dict:
        """Write files, then the manifest, then COMMIT (exclusive). A leftover uncommitted attempt is replaced."""
        d = self._start_bundle(rel)
        entries = {}
        for fname, tensors in files.items():
            blob = st_save({k: v.contiguous() for k, v in tensors.items()})
            self.fs.pipe_file(f"{d}/{fname}", blob)
            entries[fname] = {"sha256": _sha256(blob), "bytes": len(blob),
                              "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                                          for k, v in tensors.items()}}
        return self._commit(rel, entries, meta)

    def _start_bundle(self, rel: str) -> str:
        if self.is_committed(rel):
            raise AlreadyCommitted(f"{self.url}/{rel} is already committed")
        d = self.path(rel)
        if self.fs.exists(d):
            self.fs.rm(d, recursive=True)  # a crashed earlier attempt; never committed, so never read
        self.fs.makedirs(d, exist_ok=True)
        return d

    def _commit(self, rel: str, entries: dict, meta: dict[str, Any]) -> dict:
        manifest = {"format": FORMAT, "files": entries, "meta": meta, "written_at": time.time()}
        mbytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
        d = self.path(rel)
        self.fs.pipe_file(f"{d}/manifest.json", mbytes)
        try:
            with self.fs.open(f"{d}/COMMIT", "xb") as f:
                f.write(_sha256(mbytes).encode())
        except FileExistsError:
            raise AlreadyCommitted(f"{self.url}/{rel} was committed concurrently by another writer") from None
        return manifest

    # -- raw-file bundles (token shards, tokenizer.json): streamed, never parsed by the store ------------
    def write_file_bundle(self, rel: str, local_files: dict[str, str], meta: dict[str, Any]) -> dict:
        """Upload local files as they are (chunked, hashed on the way), then manifest, then COMMIT."""
        d = self._start_bundle(rel)
        entries = {}
        for fname, local in local_files.items():
            h = hashlib.sha256()
            with open(local, "rb") as src, self.fs.open(f"{d}/{fname}", "wb") as dst:
                for chunk in iter(lambda: src.read(_CHUNK), b""):
                    h.update(chunk)
                    dst.write(chunk)
            entries[fname] = {"sha256": h.hexdigest(), "bytes": os.path.getsize(local), "raw": True}
        return self._commit(rel, entries, meta)

    def fetch_file_bundle(self, rel: str, dest: str) -> dict:
        """Download a committed raw-file bundle into local folder `dest`, each file verified against its
        sha256 before it gets its real name; `dest/COMPLETE` (the manifest) marks a finished copy."""
        manifest = self.read_manifest(rel)
        os.makedirs(dest, exist_ok=True)
        for fname, entry in manifest["files"].items():
            if not entry.get("raw"):
                raise IntegrityError(f"{self.url}/{rel}/{fname} is not a raw file entry")
            if os.path.basename(fname) != fname or fname in ("COMPLETE", "manifest.json"):
                raise IntegrityError(f"{self.url}/{rel}: refusing file name {fname!r}")
            # a unique partial name: two nodes on one machine may fetch the same bundle at once
            part, h, n = os.path.join(dest, f"{fname}.{uuid.uuid4().hex[:8]}.part"), hashlib.sha256(), 0
            try:
                with self.fs.open(self.path(rel, fname), "rb") as src, open(part, "wb") as dst:
                    for chunk in iter(lambda: src.read(_CHUNK), b""):
                        h.update(chunk)
                        n += len(chunk)
                        dst.write(chunk)
            except FileNotFoundError:
                raise IntegrityError(f"{self.url}/{rel}/{fname} is missing") from None
            if n != entry["bytes"] or h.hexdigest() != entry["sha256"]:
                os.remove(part)
                raise IntegrityError(f"{self.url}/{rel}/{fname}: sha256/size mismatch ({n} bytes, manifest says "
                                     f"{entry['bytes']}); not used")
            os.replace(part, os.path.join(dest, fname))
        with open(os.path.join(dest, "COMPLETE"), "w") as f:
            json.dump(manifest, f)
        return manifest

    def read_manifest(self, rel: str) -> dict:
        d = self.path(rel)
        if not self.fs.exists(f"{d}/COMMIT"):
            raise NotCommitted(f"{self.url}/{rel} is not committed")
        want = self.fs.cat_file(f"{d}/COMMIT").decode().strip()
        try:
            mbytes = self.fs.cat_file(f"{d}/manifest.json")
        except FileNotFoundError:
            raise IntegrityError(f"{self.url}/{rel}/manifest.json is missing") from None
        if _sha256(mbytes) != want:
            raise IntegrityError(f"{self.url}/{rel}/manifest.json does not match its COMMIT checksum")
        manifest = json.loads(mbytes)
        if manifest.get("format") != FORMAT:
            raise IntegrityError(f"{self.url}/{rel}/manifest.json: unknown format {manifest.get('format')!r}")
        return manifest

    def read_bundle(self, rel: str, only: Optional[list[str]] = None) -> Bundle:
        manifest = self.read_manifest(rel)
        files = {}
        for fname, entry in manifest["files"].items():
            if only is not None and fname not in only:
                continue
            if entry.get("raw"):
                raise IntegrityError(f"{self.url}/{rel}/{fname} is a raw file, not safetensors")
            p = self.path(rel, fname)
            try:
                blob = self.fs.cat_file(p)
            except FileNotFoundError:
                raise IntegrityError(f"{self.url}/{rel}/{fname} is missing") from None
            if len(blob) != entry["bytes"] or _sha256(blob) != entry["sha256"]:
                raise IntegrityError(f"{self.url}/{rel}/{fname}: sha256/size mismatch "
                                     f"({len(blob)} bytes, manifest says {entry['bytes']}); not loaded")
            tensors = st_load(blob)
            declared = entry["tensors"]
            if set(tensors) != set(declared) or any(list(tensors[k].shape) != declared[k]["shape"] for k in tensors):
                raise IntegrityError(f"{self.url}/{rel}/{fname}: tensors differ from the manifest")
            files[fname] = tensors
        return Bundle(manifest, files)

    # -- rounds ----------------------------------------------------------------------------------
    def committed_rounds(self, run: str) -> list[int]:
        base = self.path(f"runs/{run}/rounds")
        if not self.fs.exists(base):
            return []
        out = []
        for p in self.fs.ls(base, detail=False):
            name = p.rstrip("/").rsplit("/", 1)[-1]
            if name.isdigit() and self.is_committed(self.global_dir(run, int(name))):
                out.append(int(name))
        return sorted(out)

    def latest_round(self, run: str) -> Optional[int]:
        rounds = self.committed_rounds(run)
        return rounds[-1] if rounds else None

    def supersede_after(self, run: str, r: int) -> list[int]:
        """Move rounds > r aside (runs/<run>/superseded/<stamp>/...) so a resume from r can rewrite them."""
        base = self.path(f"runs/{run}/rounds")
        if not self.fs.exists(base):
            return []
        stamp = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        moved = []
        for p in self.fs.ls(base, detail=False):
            name = p.rstrip("/").rsplit("/", 1)[-1]
            if name.isdigit() and int(name) > r:
                self.fs.mv(p, self.path(f"runs/{run}/superseded/{stamp}/{name}"), recursive=True)
                moved.append(int(name))
        return sorted(moved)

    # -- one writer per run ------------------------------------------------------------------------
    def acquire_lock(self, run: str, ttl_s: float, owner: Optional[str] = None) -> str:
        owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        p = self.path(f"runs/{run}/LOCK.json")
        self.fs.makedirs(self.path(f"runs/{run}"), exist_ok=True)
        for _ in range(2):
            body = json.dumps({"owner": owner, "expires_at": time.time() + ttl_s}).encode()
            try:
                with self.fs.open(p, "xb") as f:
                    f.write(body)
                return owner
            except FileExistsError:
                try:
                    held = json.loads(self.fs.cat_file(p))
                except (FileNotFoundError, ValueError):
                    continue
                if held.get("expires_at", 0) > time.time():
                    raise RunLocked(
                        f"run {run!r} on {self.url} is being written by {held.get('owner')} (lease until "
                        f"{time.strftime('%H:%M:%S', time.localtime(held['expires_at']))}); wait for it to finish "
                        "or let its lease expire") from None
                self.fs.rm(p)  # expired lease: its holder died
        raise RunLocked(f"could not acquire the lock of run {run!r} on {self.url}")

    def refresh_lock(self, run: str, owner: str, ttl_s: float) -> None:
        p = self.path(f"runs/{run}/LOCK.json")
        held = json.loads(self.fs.cat_file(p))
        if held.get("owner") != owner:
            raise RunLocked(f"lost the lock of run {run!r} to {held.get('owner')}")
        self.fs.pipe_file(p, json.dumps({"owner": owner, "expires_at": time.time() + ttl_s}).encode())

    def release_lock(self, run: str, owner: str) -> None:
        p = self.path(f"runs/{run}/LOCK.json")
        try:
            held = json.loads(self.fs.cat_file(p))
        except FileNotFoundError:
            return
        if held.get("owner") == owner:
            self.fs.rm(p)
