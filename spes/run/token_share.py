"""Token shards on shared storage, for nodes on other machines.

The orchestrator publishes its tokenized data once per content (`tokens_dir(key)`, key = a hash of the
index, which names every shard's sha256, and the tokenizer); a node fetches it into its local cache, each file verified against the manifest's sha256, and
memory-maps it from there. Later rounds and runs with the same data reuse the cached copy.
"""
from __future__ import annotations

import hashlib
import os

from spes.data.tokens import TokenData
from spes.errors import AlreadyCommitted
from spes.run.layout import tokens_dir
from spes.storage.file_bundles import fetch_file_bundle, write_file_bundle
from spes.storage.store import Store

INDEX_FILES = ("meta.json", "tokenizer.json")


def _token_files(folder: str) -> tuple[dict[str, str], dict[str, str]]:
    """({file name: local path} of the folder's index, tokenizer and shards, {shard: sha256 in the index})."""
    data = TokenData.open(folder)  # refuse to share a truncated or inconsistent folder
    shards = {s["file"]: s["sha256"] for split in ("train", "val") for s in data.meta["splits"][split]["shards"]}
    names = [f for f in INDEX_FILES if os.path.exists(os.path.join(folder, f))] + sorted(shards)
    return {f: os.path.join(folder, f) for f in names}, shards


def tokens_key(folder: str) -> str:
    """The content key: the index names every shard's sha256, so hashing it (and the tokenizer) suffices."""
    h = hashlib.sha256()
    for name in INDEX_FILES:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                h.update(f"{name}:{hashlib.sha256(f.read()).hexdigest()}\n".encode())
    return h.hexdigest()[:20]


def publish_tokens(store: Store, folder: str) -> str:
    """Upload the token folder unless storage already holds the same content; returns its key. A shard whose
    bytes differ from its index's sha256 is refused before anything is committed."""
    files, shard_sha = _token_files(folder)
    key = tokens_key(folder)
    if not store.is_committed(tokens_dir(key)):
        try:
            write_file_bundle(store, tokens_dir(key), files, {"kind": "tokens", "key": key}, expect=shard_sha)
        except AlreadyCommitted:
            pass  # another orchestrator published the same content meanwhile
    return key


def fetch_tokens(store: Store, key: str, cache_dir: str) -> TokenData:
    """The shared token data `key`, from the local cache or downloaded (verified) into it."""
    dest = os.path.join(os.path.expanduser(cache_dir), "tokens", key)
    if not os.path.exists(os.path.join(dest, "COMPLETE")):
        fetch_file_bundle(store, tokens_dir(key), dest)
    return TokenData.open(dest)
