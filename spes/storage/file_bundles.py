"""Raw-file bundles on shared storage (token shards, tokenizer.json): the bundle format of spes/storage/store.py,
but the files are uploaded as they are, streamed and hashed on the way, and never parsed by the store."""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Any, Optional

from spes.errors import IntegrityError
from spes.storage.store import CHUNK, Store


def write_file_bundle(store: Store, rel: str, local_files: dict[str, str], meta: dict[str, Any],
                      expect: Optional[dict[str, str]] = None) -> dict:
    """Upload local files as they are (chunked, hashed on the way), then manifest, then COMMIT; a file whose
    sha256 differs from `expect[name]` stops the upload before the commit (nothing becomes visible)."""
    store.start_bundle(rel)
    entries = {}
    for fname, local in local_files.items():
        def upload(local=local, fname=fname):
            h = hashlib.sha256()
            with open(local, "rb") as src, store.writer(f"{rel}/{fname}") as dst:
                for chunk in iter(lambda: src.read(CHUNK), b""):
                    h.update(chunk)
                    dst.write(chunk)
            return h.hexdigest()

        entries[fname] = {"sha256": store._io(f"upload {rel}/{fname}", upload), "bytes": os.path.getsize(local),
                          "raw": True}
        store.bytes_written += entries[fname]["bytes"]
        if expect and fname in expect and entries[fname]["sha256"] != expect[fname]:
            raise IntegrityError(f"{local}: sha256 {entries[fname]['sha256'][:12]} differs from its index "
                                 f"({expect[fname][:12]}); not published")
    return store.commit_bundle(rel, entries, meta)


def fetch_file_bundle(store: Store, rel: str, dest: str) -> dict:
    """Download a committed raw-file bundle into local folder `dest`, each file verified against its
    sha256 before it gets its real name; `dest/COMPLETE` (the manifest) marks a finished copy."""
    manifest = store.read_manifest(rel)
    os.makedirs(dest, exist_ok=True)
    for fname, entry in manifest["files"].items():
        if not entry.get("raw"):
            raise IntegrityError(f"{store.url}/{rel}/{fname} is not a raw file entry")
        if os.path.basename(fname) != fname or fname in ("COMPLETE", "manifest.json"):
            raise IntegrityError(f"{store.url}/{rel}: refusing file name {fname!r}")
        # a unique partial name: two nodes on one machine may fetch the same bundle at once
        part = os.path.join(dest, f"{fname}.{uuid.uuid4().hex[:8]}.part")

        def download():
            h, n = hashlib.sha256(), 0
            with store.reader(f"{rel}/{fname}", entry["bytes"]) as src, open(part, "wb") as dst:
                for chunk in iter(lambda: src.read(CHUNK), b""):
                    h.update(chunk)
                    n += len(chunk)
                    dst.write(chunk)
            return h.hexdigest(), n

        try:
            digest, n = store._io(f"download {rel}/{fname}", download)
        except FileNotFoundError:
            raise IntegrityError(f"{store.url}/{rel}/{fname} is missing") from None
        except BaseException:
            if os.path.exists(part):
                os.remove(part)
            raise
        store.bytes_read += n
        if n != entry["bytes"] or digest != entry["sha256"]:
            os.remove(part)
            raise IntegrityError(f"{store.url}/{rel}/{fname}: sha256/size mismatch ({n} bytes, manifest says "
                                 f"{entry['bytes']}); not used")
        os.replace(part, os.path.join(dest, fname))
    with open(os.path.join(dest, "COMPLETE"), "w") as f:
        json.dump(manifest, f)
    return manifest
