"""How a node gets global round r: rebuilt from the delta bundles since the global it holds (each step checked
against the committed sha256), or downloaded whole when that chain is broken. The arithmetic is
spes/sync/deltas.py's; this is the reading of it from storage."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from safetensors.torch import load as st_load

from spes.errors import IntegrityError, NotCommitted, RecordError
from spes.round.context import RoundContext
from spes.run.layout import MODEL_FILE, RunLayout
from spes.run.records import DeltaMeta
from spes.storage.store import Store
from spes.storage.tensorio import tensors_sha256
from spes.sync.deltas import apply_delta

log = logging.getLogger("spes.round.fetch")


def delta_meta(store: Store, layout: RunLayout, q: int, dm: dict) -> DeltaMeta:
    return DeltaMeta.from_json(dm["meta"], f"{store.url}/{layout.delta_dir(q)}")


def delta_files(store: Store, layout: RunLayout, q: int, dm: dict, local_files: Optional[dict] = None) -> dict:
    """The tensors of delta q (manifest `dm`): its own files and the owners' uploads it refers to, each
    verified against the sha256 the delta recorded; `local_files` = {fname: (sha256, tensors)} held here."""
    local_files = local_files or {}

    def held(fname, sha):
        return fname in local_files and local_files[fname][0] == sha

    files = {f: local_files[f][1] for f, e in dm["files"].items() if held(f, e["sha256"])}
    files.update(store.read_bundle(layout.delta_dir(q), [f for f in dm["files"] if f not in files], dm).files)
    for fname, ref in delta_meta(store, layout, q, dm).expert_files.items():
        if ref.source is None or ref.file is None:
            continue
        if held(fname, ref.sha256):
            files[fname] = local_files[fname][1]
        else:
            files[fname] = st_load(store.read_verified(ref.source, ref.file, {"sha256": ref.sha256, "bytes": ref.bytes}))
    return files


@dataclass
class Chain:
    """Where a node's rebuild of a global starts: the global it holds, `mark` = (round, sha256), loaded by
    `load()`; `local_files` = {fname: (sha256, tensors)} it holds too (its own last upload), read from here
    instead of storage."""

    mark: Optional[tuple[int, str]]
    load: Callable[[], dict]
    local_files: Optional[dict[str, tuple[str, dict]]] = None


def fetch_global(ctx: RoundContext, r: int, manifest: dict, chain: Optional[Chain] = None,
                 store: Optional[Store] = None) -> tuple[dict[str, torch.Tensor], str]:
    """Global r for a node holding `chain`'s global: rebuilt from the delta bundles since it (each step checked
    against the committed sha256), or the whole committed model when the chain is missing. `manifest` is
    global r's; `store`: the context's storage counted apart (a prefetch), else the context's. Returns
    (tensors, sha256)."""
    store = store if store is not None else ctx.store
    layout, codec, method = ctx.layout, ctx.codec, ctx.method
    base = chain.mark if chain is not None else None
    local_files = chain.local_files if chain is not None else None
    want = manifest["files"][MODEL_FILE]["sha256"]
    if base is not None and base[0] <= r:
        k, sha = base
        try:
            assert chain is not None
            tensors = chain.load()
        except IntegrityError:  # the copy held here is damaged (the loader says which): the committed one
            return store.read_bundle(layout.global_dir(r), [MODEL_FILE], manifest).files[MODEL_FILE], want
        for q in range(k + 1, r + 1):
            try:
                dm = store.read_manifest(layout.delta_dir(q))
                meta = delta_meta(store, layout, q, dm)
            except NotCommitted:
                break
            except (IntegrityError, RecordError) as e:  # a damaged delta: the committed global is the truth
                log.warning("delta %d unusable (%s); downloading global %d whole", q, e, r)
                break
            if meta.base_sha256 != sha:
                break
            try:
                files = delta_files(store, layout, q, dm, local_files)
            except (IntegrityError, NotCommitted, RecordError) as e:  # e.g. an upload it refers to was pruned meanwhile
                log.warning("delta %d unusable (%s); downloading global %d whole", q, e, r)
                break
            tensors = apply_delta(tensors, codec, method, files, {f: ref.rows for f, ref in meta.expert_files.items()})
            sha = tensors_sha256(tensors)
            if sha != meta.global_sha256:
                log.warning("rebuilt global %d differs from the committed one (%s != %s); downloading it whole",
                            q, sha[:12], meta.global_sha256[:12])
                break
        else:
            if sha == want:
                return tensors, sha
    return store.read_bundle(layout.global_dir(r), [MODEL_FILE], manifest).files[MODEL_FILE], want
