"""A run's committed rounds on shared storage, as storage holds them: which rounds are committed, their
globals (checked against the model config they record), the node states and index each global carries,
round records, and moving rounds aside (never deleting them) so that a resume can rewrite them.
Run (spes/run/run.py) builds identity, resume and retention on top.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Optional

from spes.config.schema import ModelConfig, StorageConfig
from spes.errors import NotCommitted, RecordError
from spes.model.names import canonical_shapes
from spes.model.transformer import CausalLM
from spes.run.layout import MODEL_FILE, RunLayout
from spes.run.records import GlobalMeta, RoundRecord, RunIndex, StateRef
from spes.storage.store import Store

log = logging.getLogger("spes.run")


def next_index(prev: Optional[RunIndex], r: int, node_states: dict[int, StateRef]) -> RunIndex:
    """The index global r carries: global r-1's, plus r when every node's state it was built with is
    checkpointed on shared storage (a resume from anywhere can start after r)."""
    resumable = list(prev.storage_resumable if prev is not None else [0])
    if all(ref.checkpoint for ref in node_states.values()) and r not in resumable:
        resumable.append(r)
    return RunIndex(storage_resumable=resumable)


class RunRounds:
    """The rounds of run `name` on `store`. With `keep_globals` (the run's writer: the flow holding its lease,
    the only process that commits or moves its globals) the handle keeps the last global manifests it read or
    committed instead of reading them again; moving rounds aside forgets them."""

    KEPT = 2
    """Global manifests kept (r-1 and r: what a round's driver, aggregator and retention read)."""

    def __init__(self, store: Store, name: str, keep_globals: bool = False):
        self.store, self.layout, self.name = store, RunLayout(name), name
        self._keep_globals = keep_globals
        self._globals: dict[int, dict] = {}

    @classmethod
    def open(cls, storage: StorageConfig, name: str, keep_globals: bool = False, role: str = ""):
        """Run `name` on the storage the settings' `storage` section names; `role`: whose work (FileStore.role)."""
        return cls(Store.from_config(storage, role), name, keep_globals)

    def global_manifest(self, r: int) -> dict:
        """Committed global r's manifest (kept, for the writer)."""
        manifest = self._globals.get(r)
        if manifest is None:
            manifest = self.store.read_manifest(self.layout.global_dir(r))
            self._keep(r, manifest)
        return manifest

    def committed_global(self, r: int, manifest: dict) -> None:
        """The writer committed global r with this manifest: kept as a read would return it."""
        self._keep(r, json.loads(json.dumps(manifest)))

    def forget_globals(self) -> None:
        """Read the globals anew from here on (the writer's lease was just taken: what was read before it may
        have been moved aside by another writer)."""
        self._globals.clear()

    def forget_global(self, r: int) -> None:
        """Global r is being removed from storage: a later read must not find it here."""
        self._globals.pop(r, None)

    def _keep(self, r: int, manifest: dict) -> None:
        if self._keep_globals:
            self._globals[r] = manifest
            for q in sorted(self._globals)[:-self.KEPT]:
                del self._globals[q]

    # -- rounds ------------------------------------------------------------------------------------
    def _round_names(self) -> list[int]:
        return sorted(int(n) for n in self.store.list_names(self.layout.rounds_dir) if n.isdigit())

    def latest_round(self) -> Optional[int]:
        """The latest committed round: one listing, then COMMIT markers from the top (a round being written
        has no marker yet)."""
        for r in reversed(self._round_names()):
            if self.store.is_committed(self.layout.global_dir(r)):
                return r
        return None

    def committed_rounds(self) -> list[int]:
        """Rounds whose global is still on storage (retention deletes older globals' models)."""
        return [r for r in self._round_names() if self.store.is_committed(self.layout.global_dir(r))]

    def global_meta(self, r: int) -> GlobalMeta:
        return GlobalMeta.from_json(self.global_manifest(r)["meta"], f"{self.store.url}/{self.layout.global_dir(r)}")

    def check_global(self, r: int, manifest: Optional[dict] = None) -> GlobalMeta:
        """Before a round starts from global r: its meta and its model file's tensors (names, shapes) fit the
        model config it records; a damaged manifest stops here, naming the file, not inside a node."""
        rel = self.layout.global_dir(r)
        manifest = manifest if manifest is not None else self.global_manifest(r)
        meta = GlobalMeta.from_json(manifest["meta"], f"{self.store.url}/{rel}")
        try:
            want = canonical_shapes(ModelConfig(**meta.model_config))
        except TypeError as e:
            raise RecordError(f"{self.store.url}/{rel}/manifest.json: model_config does not fit the schema ({e})") from None
        entry = manifest["files"].get(MODEL_FILE)
        got = {n: tuple(t.get("shape", ())) for n, t in (entry or {}).get("tensors", {}).items()}
        if got != want:
            bad = sorted(set(got.items()) ^ set(want.items()))[:3]
            raise RecordError(f"{self.store.url}/{rel}/manifest.json: its tensors do not fit its model config "
                              f"(e.g. {bad})")
        return meta

    def verify_global(self, r: int) -> GlobalMeta:
        """check_global, and every byte of the model file against its sha256, parsed as safetensors."""
        rel = self.layout.global_dir(r)
        manifest = self.store.read_manifest(rel)
        meta = self.check_global(r, manifest)
        self.store.read_bundle(rel, [MODEL_FILE], manifest)
        return meta

    def node_states(self, r: int) -> dict[int, StateRef]:
        """The node states global r was built with."""
        return self.global_meta(r).node_states

    def index(self, r: int) -> RunIndex:
        """The index global r carries (globals written before indexes: rebuilt once from the ones before)."""
        meta = self.global_meta(r)
        if meta.index is not None:
            return meta.index
        index = None
        for q in self.committed_rounds():
            if q <= r:
                index = next_index(index, q, meta.node_states if q == r else self.node_states(q))
        return index or RunIndex()

    # -- moving rounds aside ------------------------------------------------------------------------
    def supersede_after(self, r: int, include_info: bool = False) -> list[int]:
        """Move rounds > r aside (never deleted) so a resume from r can rewrite them."""
        # sortable by time to the nanosecond (retention keeps the newest), unique across writers
        stamp = time.strftime("%Y%m%dT%H%M%S") + f".{time.time_ns() % 10**9:09d}-" + uuid.uuid4().hex[:6]
        dest = self.layout.superseded_dir(stamp)
        self.forget_globals()
        moved = []
        for name in self.store.list_names(self.layout.rounds_dir):
            if name.isdigit() and int(name) > r:
                self.store.move(self.layout.round_dir(int(name)), f"{dest}/{name}")
                moved.append(int(name))
        if include_info and self.store.exists(self.layout.info):
            self.store.move(self.layout.info, f"{dest}/info")
        return sorted(moved)

    def prune_superseded(self, keep: Optional[int]) -> list[str]:
        """Retention of superseded/: the last `keep` stamps stay (None = all); returns those deleted."""
        if keep is None:
            return []
        stamps = self.store.list_names(f"{self.layout.base}/superseded")  # stamps sort by time
        gone = stamps[:-keep] if len(stamps) > keep else []
        for stamp in gone:
            self.store.remove(self.layout.superseded_dir(stamp))
        if gone:
            log.info("run %s: retention deleted superseded rounds %s (storage.keep_superseded=%d)", self.name, gone,
                     keep)
        return gone

    def load_model(self, r: int):
        """Global round r as a model (config from the round's meta), and its manifest."""
        rel = self.layout.global_dir(r)
        b = self.store.read_bundle(rel, only=[MODEL_FILE])
        meta = GlobalMeta.from_json(b.meta, f"{self.store.url}/{rel}")
        model = CausalLM(ModelConfig(**meta.model_config))
        model.load_canonical_state_dict(b.files[MODEL_FILE])
        return model, b.manifest

    # -- records -----------------------------------------------------------------------------------
    def write_record(self, r: int, record: RoundRecord) -> None:
        if not self.store.is_committed(self.layout.record_dir(r)):
            self.store.write_bundle(self.layout.record_dir(r), {}, record.to_json())

    def record(self, r: int) -> Optional[RoundRecord]:
        rel = self.layout.record_dir(r)
        try:
            meta = self.store.read_manifest(rel)["meta"]
        except NotCommitted:
            return None
        return RoundRecord.from_json(meta, f"{self.store.url}/{rel}")

    def records(self, first: int, last: int) -> list[RoundRecord]:
        """How rounds first..last went, for those with a record (a stage re-run reports these)."""
        return [rec for rec in (self.record(r) for r in range(first, last + 1)) if rec is not None]
