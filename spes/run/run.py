"""A run's state on shared storage: identity, committed rounds, where to resume, round records.

A run is identified by a fingerprint of the settings that change its maths (model, init, data, SPES
settings; only values that differ from the schema's defaults count, so a release that adds a setting at
a backward-compatible default leaves runs resumable) and by its initial model (the sha256 of round 0's
model file). Committed rounds are reused only by a run with the same identity.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from safetensors.torch import load_file

from spes.config.loader import to_dict
from spes.config.schema import ModelConfig, Params
from spes.errors import NotCommitted, RunMismatch, StorageError
from spes.model.transformer import CausalLM, canonical_shapes
from spes.run.layout import MODEL_FILE, RunLayout
from spes.storage.store import Store
from spes.storage.tensorio import tensors_sha256

FINGERPRINT_SECTIONS = ("model", "init", "spes", "sync", "tokenize", "data", "dense")
NOT_IN_FINGERPRINT = {"model": ("experts_impl",)}
"""Implementation choices that leave the maths alone, like the device and storage placement."""
log = logging.getLogger("spes.run")


def _non_default(d: Any, default: Any) -> Any:
    if isinstance(d, dict) and isinstance(default, dict):
        out = {k: _non_default(v, default.get(k)) for k, v in d.items() if k not in default or v != default[k]}
        return {k: v for k, v in out.items() if v != {} or k not in default}
    return d


def fingerprint_of(settings: dict) -> str:
    """Hash of the settings that differ from the schema's defaults (see the module docstring)."""
    defaults = to_dict(Params())
    keep = {}
    for k in FINGERPRINT_SECTIONS:
        section = {n: v for n, v in settings.get(k, {}).items() if n not in NOT_IN_FINGERPRINT.get(k, ())}
        keep[k] = _non_default(section, defaults[k])
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def settings_fingerprint(p: Params) -> str:
    return fingerprint_of(to_dict(p))


@dataclass
class InitModel:
    """Round 0 of a run: canonical tensors, the model config they belong to, where they came from."""

    tensors: dict[str, torch.Tensor]
    model_config: dict
    source: str

    @property
    def sha256(self) -> str:
        """The sha256 of round 0's model file once committed (bundles write tensors sorted by name)."""
        return tensors_sha256(self.tensors)

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> "InitModel":
        return cls({k: v.detach().cpu() for k, v in tensors.items()}, dataclasses.asdict(cfg), source)

    @classmethod
    def load(cls, path: str) -> "InitModel":
        """The `upcycle` stage's output: `model.safetensors` + `config.json` beside it (checked to match)."""
        with open(os.path.join(os.path.dirname(path), "config.json")) as f:
            cfg = json.load(f)
        tensors = load_file(path)
        want = canonical_shapes(ModelConfig(**cfg["model_config"]))
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if got != want:
            bad = sorted(set(got.items()) ^ set(want.items()))[:3]
            raise StorageError(f"init model {path} does not match its config.json (e.g. {bad})")
        return cls(tensors, cfg["model_config"], cfg.get("source", "init"))


class Run:
    def __init__(self, store: Store, name: str):
        self.store, self.layout, self.name = store, RunLayout(name), name

    # -- identity ----------------------------------------------------------------------------------
    def info(self) -> Optional[dict]:
        try:
            return self.store.read_manifest(self.layout.info)["meta"]
        except NotCommitted:
            return None

    def _write_info(self, fingerprint: str, init_sha: str) -> None:
        self.store.write_bundle(self.layout.info, {}, {"fingerprint": fingerprint, "init_sha256": init_sha,
                                                       "run_id": uuid.uuid4().hex, "created_at": time.time()})

    def _round0_sha(self) -> Optional[str]:
        try:
            return self.store.read_manifest(self.layout.global_dir(0))["files"][MODEL_FILE]["sha256"]
        except NotCommitted:
            return None

    def ensure(self, fingerprint: str, init: Optional[InitModel], on_mismatch: str = "error") -> None:
        """Make the run exist with this identity: round 0 from `init` (or already committed by whoever
        started the run), the info bundle; refuse, or with on_mismatch='restart' set aside, a run made with
        other settings or another initial model."""
        init_sha = init.sha256 if init is not None else None
        info = self.info()
        if info is not None:
            same = info["fingerprint"] == fingerprint and init_sha in (None, info["init_sha256"])
            if same:
                return
            if on_mismatch != "restart":
                what = "settings" if info["fingerprint"] != fingerprint else "initial model"
                raise RunMismatch(f"run {self.name!r} on {self.store.url} was made with another {what} "
                                  f"(fingerprint {info['fingerprint']}, now {fingerprint}); use another "
                                  "orchestration.run_name or restart it")
            moved = self.supersede_after(-1, include_info=True)
            log.warning("settings changed: rounds %s of run %s moved to superseded/", moved, self.name)
        if self._round0_sha() is None:
            if init is None:
                raise StorageError(f"run {self.name!r} does not exist on {self.store.url} and no init model was given")
            meta = {"round": 0, "step": 0, "source": init.source, "model_config": init.model_config,
                    "contributors": [], "missing": []}
            self.store.write_bundle(self.layout.global_dir(0), {MODEL_FILE: init.tensors}, meta)
        self._write_info(fingerprint, self._round0_sha())

    # -- rounds ------------------------------------------------------------------------------------
    def committed_rounds(self) -> list[int]:
        return [int(n) for n in self.store.list_names(self.layout.rounds_dir)
                if n.isdigit() and self.store.is_committed(self.layout.global_dir(int(n)))]

    def latest_round(self) -> Optional[int]:
        rounds = self.committed_rounds()
        return rounds[-1] if rounds else None

    def node_states(self, r: int) -> dict[int, dict]:
        """The node states global r was built with: node -> {round, digest, checkpoint}."""
        meta = self.store.read_manifest(self.layout.global_dir(r))["meta"]
        return {int(i): ref for i, ref in meta.get("node_states", {}).items()}

    def _checkpointed(self, node: int, ref: dict) -> bool:
        from spes.run.node_state import state_digest

        if not ref.get("checkpoint"):
            return False
        try:
            return state_digest(self.store.read_manifest(self.layout.state_dir(int(ref["round"]), node))) == ref["digest"]
        except NotCommitted:
            return False

    def resumable_rounds(self, has_local_state: Optional[Callable[[int, dict], bool]] = None) -> list[int]:
        """Committed rounds every node can continue from: each node's state that round's global was built
        with is checkpointed on shared storage, or (when `has_local_state` can tell) in the node's own folder.
        Without `has_local_state` (nodes on other machines) the latest round counts as resumable: nodes keep
        their latest state; one that lacks it fails with a message naming what is missing."""
        committed = self.committed_rounds()
        out = []
        for r in committed:
            refs = self.node_states(r)
            ok = all(self._checkpointed(i, ref) or (has_local_state is not None and has_local_state(i, ref))
                     for i, ref in refs.items())
            if ok or (has_local_state is None and r == committed[-1]):
                out.append(r)
        return out

    def resolve_start(self, resume_round: Union[int, str, None],
                      has_local_state: Optional[Callable[[int, dict], bool]] = None) -> int:
        """The first round to run: after the latest resumable round (None / 'latest'), or after
        `resume_round`; later committed rounds are set aside so they are recomputed."""
        committed = self.committed_rounds()
        if not committed:
            raise StorageError(f"run {self.name!r} has no committed round on {self.store.url}")
        resumable = self.resumable_rounds(has_local_state)
        if resume_round in (None, "latest"):
            k = resumable[-1]
            if k != committed[-1]:
                log.warning("run %s: continuing from round %d, the latest resumable one (rounds %s lack node "
                            "states: not checkpointed, not on the nodes)", self.name, k, [c for c in committed if c > k])
        else:
            try:
                k = int(resume_round)
            except (TypeError, ValueError):
                raise StorageError(f"resume_round must be 'latest' or a round number, got {resume_round!r}") from None
            if k not in committed:
                raise StorageError(f"run {self.name!r}: round {k} is not committed (committed: {committed})")
            if k not in resumable:
                raise StorageError(f"run {self.name!r}: round {k} is not resumable: some node's state after it is "
                                 f"neither checkpointed nor on its node (resumable: {resumable})")
        moved = self.supersede_after(k)
        if moved:
            log.warning("resuming from round %d: rounds %s moved to %s/superseded/", k, moved, self.layout.base)
        log.info("run %s: resuming after round %d", self.name, k)
        return k + 1

    def prune(self, keep_rounds: Optional[int], keep_checkpoints: Optional[int] = None) -> list[int]:
        """Retention (storage.keep_rounds): the last `keep_rounds` committed rounds stay whole (their deltas
        refer to the node uploads of the round); round 0 and the rounds a resume can start from from shared
        storage (the last `keep_checkpoints` of them, or all) keep their global and the node states they
        need; every other round keeps only its record. Returns the rounds whose model was deleted."""
        if keep_rounds is None:
            return []
        committed = self.committed_rounds()
        window = set(committed[-keep_rounds:])
        from_storage = [r for r in self.resumable_rounds(lambda i, ref: False) if r > 0]
        from_storage = set(from_storage[-keep_checkpoints:] if keep_checkpoints else from_storage) | {0}
        keep = window | from_storage
        needed_states = {(int(ref["round"]), i) for r in keep for i, ref in self.node_states(r).items()
                         if ref.get("checkpoint")}
        dropped = []
        for r in committed:
            if r not in window:
                self.store.remove(self.layout.delta_dir(r))
                self.store.remove(f"{self.layout.round_dir(r)}/nodes")
            for name in self.store.list_names(f"{self.layout.round_dir(r)}/states"):
                if name.isdigit() and (r, int(name)) not in needed_states and r not in window:
                    self.store.remove(self.layout.state_dir(r, int(name)))
            if r not in keep:
                self.store.remove(self.layout.global_dir(r))
                dropped.append(r)
        return dropped

    def supersede_after(self, r: int, include_info: bool = False) -> list[int]:
        """Move rounds > r aside (never deleted) so a resume from r can rewrite them."""
        stamp = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        dest = self.layout.superseded_dir(stamp)
        moved = []
        for name in self.store.list_names(self.layout.rounds_dir):
            if name.isdigit() and int(name) > r:
                self.store.move(self.layout.round_dir(int(name)), f"{dest}/{name}")
                moved.append(int(name))
        if include_info and self.store.exists(self.layout.info):
            self.store.move(self.layout.info, f"{dest}/info")
        return sorted(moved)

    def load_model(self, r: int):
        """Global round r as a model (config from the round's meta), and its manifest."""
        b = self.store.read_bundle(self.layout.global_dir(r), only=[MODEL_FILE])
        model = CausalLM(ModelConfig(**b.meta["model_config"]))
        model.load_canonical_state_dict(b.files[MODEL_FILE])
        return model, b.manifest

    # -- records -----------------------------------------------------------------------------------
    def write_record(self, r: int, record: dict) -> None:
        if not self.store.is_committed(self.layout.record_dir(r)):
            self.store.write_bundle(self.layout.record_dir(r), {}, record)

    def records(self, first: int, last: int) -> list[dict]:
        """How rounds first..last went, for those with a record (a stage re-run reports these)."""
        out = []
        for r in range(first, last + 1):
            try:
                out.append(self.store.read_manifest(self.layout.record_dir(r))["meta"])
            except NotCommitted:
                continue
        return out
