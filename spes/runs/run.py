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
from typing import Any, Optional, Union

import torch
from safetensors.torch import load_file
from safetensors.torch import save as st_save

from spes.config import ModelConfig, Params
from spes.model import canonical_shapes
from spes.params import to_dict
from spes.runs.layout import MODEL_FILE, RunLayout
from spes.store import NotCommitted, Store, StoreError, sha256_bytes

FINGERPRINT_SECTIONS = ("model", "init", "spes", "tokenize", "dense")
NOT_IN_FINGERPRINT = {"model": ("experts_impl",)}
"""Implementation choices that leave the maths alone, like the device and storage placement."""
log = logging.getLogger("spes.runs")


class RunMismatch(StoreError):
    """Storage holds a run of this name made with other settings or another initial model."""


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
    def blob(self) -> bytes:
        return st_save({k: v.contiguous() for k, v in self.tensors.items()})

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
            raise StoreError(f"init model {path} does not match its config.json (e.g. {bad})")
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
        init_sha = sha256_bytes(init.blob) if init is not None else None
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
                raise StoreError(f"run {self.name!r} does not exist on {self.store.url} and no init model was given")
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

    def resolve_start(self, resume_round: Union[int, str, None]) -> int:
        """The first round to run: after the latest committed round, or after `resume_round` (whose later
        rounds are set aside so they can be recomputed)."""
        committed = self.committed_rounds()
        if not committed:
            raise StoreError(f"run {self.name!r} has no committed round on {self.store.url}")
        if resume_round in (None, "latest"):
            return committed[-1] + 1
        try:
            k = int(resume_round)
        except (TypeError, ValueError):
            raise StoreError(f"resume_round must be 'latest' or a round number, got {resume_round!r}") from None
        if k not in committed:
            raise StoreError(f"run {self.name!r}: round {k} is not committed (committed: {committed})")
        moved = self.supersede_after(k)
        if moved:
            log.warning("resuming from round %d: rounds %s moved to %s/superseded/", k, moved, self.layout.base)
        return k + 1

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
