"""Token shards on shared storage, for nodes on other machines.

The orchestrator publishes its tokenized data once per content (`tokens_dir(key)`, key = a hash of the
files); a node fetches it into its local cache, each file verified against the manifest's sha256, and
memory-maps it from there. Later rounds and runs with the same data reuse the cached copy.
"""
from __future__ import annotations

import hashlib
import os

from spes.data import DataError, TokenData
from spes.runs.layout import tokens_dir
from spes.store import AlreadyCommitted, Store

TOKEN_FILES = ("meta.json", "train.bin", "val.bin", "tokenizer.json")
_REQUIRED = ("meta.json", "train.bin", "val.bin")


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _token_files(folder: str) -> dict[str, str]:
    missing = [f for f in _REQUIRED if not os.path.exists(os.path.join(folder, f))]
    if missing:
        raise DataError(f"no token data to share at {folder!r} (missing {', '.join(missing)}); run the tokenize stage")
    return {f: os.path.join(folder, f) for f in TOKEN_FILES if os.path.exists(os.path.join(folder, f))}


def tokens_key(folder: str) -> str:
    files = _token_files(folder)
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}:{_file_sha256(files[name])}\n".encode())
    return h.hexdigest()[:20]


def publish_tokens(store: Store, folder: str) -> str:
    """Upload the token folder unless storage already holds the same content; returns its key."""
    TokenData.open(folder)  # refuse to share a truncated or inconsistent folder
    key = tokens_key(folder)
    if not store.is_committed(tokens_dir(key)):
        try:
            store.write_file_bundle(tokens_dir(key), _token_files(folder), {"kind": "tokens", "key": key})
        except AlreadyCommitted:
            pass  # another orchestrator published the same content meanwhile
    return key


def fetch_tokens(store: Store, key: str, cache_dir: str) -> TokenData:
    """The shared token data `key`, from the local cache or downloaded (verified) into it."""
    dest = os.path.join(os.path.expanduser(cache_dir), "tokens", key)
    if not os.path.exists(os.path.join(dest, "COMPLETE")):
        store.fetch_file_bundle(tokens_dir(key), dest)
    return TokenData.open(dest)
