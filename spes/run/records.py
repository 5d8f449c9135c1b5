"""The round protocol's metadata as typed, versioned records, read and written in this one place.

    StateRef      which node state a global was built with (in GlobalMeta.node_states)
    UploadMeta    a node's committed upload (rounds/<r>/nodes/<i>/ manifest meta)
    NodeReport    what a node reports for a round: its upload meta, every byte it moved, its status
    DeltaMeta     what nodes download (rounds/<r>/delta/ manifest meta)
    GlobalMeta    a committed global model (rounds/<r>/global/ manifest meta), with the run's index
    RunIndex      what resume and retention need, carried forward from global to global (O(1) per round)
    RoundRecord   how a round went (rounds/<r>/record/ manifest meta), its held-out slice window by window

Each record is a dataclass with `to_json()` and `from_json(d, where)`; `from_json` checks the shape (keys,
types: pydantic, strict) and raises RecordError naming the file. `version` is RECORD_VERSION when written;
one without it is version 0 (before records had versions), read the same way where its fields allow."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import TypeAdapter, ValidationError

from spes.errors import RecordError

RECORD_VERSION = 1

_ADAPTERS: dict[type, TypeAdapter] = {}


def _adapter(cls: type) -> TypeAdapter:
    """pydantic's validator of a record class, built once (building one takes milliseconds)."""
    if cls not in _ADAPTERS:
        _ADAPTERS[cls] = TypeAdapter(cls)
    return _ADAPTERS[cls]


def _problem(cls: type, e: ValidationError) -> str:
    """The first thing wrong with a record, in words: the key (dotted) and what it should be."""
    err = e.errors()[0]
    key = ".".join(str(part) for part in err["loc"] if part != "[key]")
    if err["type"] == "missing":
        return f"{cls.__name__} lacks {key!r}"
    got = err.get("input")
    return f"{key or cls.__name__}: {err['msg'].lower()}, got {got!r}" + (
        f" (and {e.error_count() - 1} more problems)" if e.error_count() > 1 else "")


def _nested(value: Any):
    """The records inside a record's field value (records inside records, lists and dicts of them)."""
    if isinstance(value, Record):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _nested(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _nested(v)


def _to_json(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    return value


class Record:
    """to_json / from_json for a dataclass whose fields are JSON values, lists, dicts or other records."""

    def to_json(self) -> dict:
        return {f.name: _to_json(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]  # a dataclass

    @classmethod
    def from_json(cls, d: Any, where: str):
        """The record in `d` (parsed JSON), its shape checked by pydantic in strict JSON mode (no "3" for 3, no
        true for 1; JSON's string keys read as the int keys a field declares), then what must hold of it as a
        whole (`check`), records inside it included; a RecordError naming `where` otherwise."""
        if not isinstance(d, dict):
            raise RecordError(f"{where}: a {cls.__name__} must be a JSON object, got {type(d).__name__}")
        try:
            record = _adapter(cls).validate_json(json.dumps(d), strict=True)
        except ValidationError as e:
            raise RecordError(f"{where}: {_problem(cls, e)}") from None
        record._check_all(where)
        return record

    def _check_all(self, where: str) -> None:
        version = getattr(self, "version", 0)
        if version > RECORD_VERSION:
            raise RecordError(f"{where}: record version {version} is newer than this code's ({RECORD_VERSION})")
        for f in dataclasses.fields(self):  # type: ignore[arg-type]  # a dataclass
            for inner in _nested(getattr(self, f.name)):
                inner._check_all(where)
        self.check(where)

    def check(self, where: str) -> None:
        """What must hold of the record as a whole (fields that must agree), beyond each field's type: a
        RecordError naming `where`. Nothing by default."""


@dataclass(frozen=True)
class StateRef(Record):
    """A node's state after round `round`, by digest; `checkpoint`: also on shared storage."""

    round: int
    digest: str
    checkpoint: bool


@dataclass
class UploadMeta(Record):
    round: int
    node: int
    experts: list[int]
    tokens: int
    base_round: int
    base_sha256: str
    codec: str
    state: StateRef
    step_end: int
    loss_first: float
    loss_last: float
    loss_mean: float
    losses: list[float]
    expert_load: list
    ranks: int
    bytes_down: int
    seconds_load: float
    seconds_compute: float
    device: str
    peak_bytes: Optional[int] = None
    bytes_up_files: int = 0
    state_bytes: Optional[int] = None
    """Weights, gradients and Adam moments the node's (first) rank held after its last step, counted."""
    grad_norms: list[float] = field(default_factory=list)
    """Each local step's gradient norm before clipping (empty in records written before it was kept)."""
    lb_losses: list[float] = field(default_factory=list)
    """Each local step's load-balancing term, before its coefficient (empty: a dense model, or an older record)."""
    z_losses: list[float] = field(default_factory=list)
    """Each local step's router z-loss term, before its coefficient (empty: a dense model, or an older record)."""
    timeline: list[list[float]] = field(default_factory=list)
    """[local steps done, seconds of compute] at each progress line (orchestration.log_every_steps)."""
    seconds_read: float = 0.0
    """Reading global r-1 (downloaded or rebuilt) and the node's state; seconds_upload: writing the upload's
    files (its manifest and commit marker, written after, not in it)."""
    seconds_upload: float = 0.0
    version: int = RECORD_VERSION


@dataclass
class NodeReport(Record):
    """A node's row of a round: 'ok' with its upload's meta and traffic, or 'timeout' / 'failed: ...'."""

    node: int
    status: str
    upload: Optional[UploadMeta] = None
    bytes_up: int = 0
    seconds_save: float = 0.0
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.upload is not None

    @property
    def bytes_down(self) -> int:
        return self.upload.bytes_down if self.upload else 0

    @property
    def tokens(self) -> int:
        return self.upload.tokens if self.upload else 0

    @property
    def seconds_compute(self) -> float:
        return self.upload.seconds_compute if self.upload else 0.0


@dataclass
class ExpertRef(Record):
    """Where owner j's expert rows of a delta are: in the delta bundle itself (merging rounds), or the owner's
    upload (`source` bundle, `file`, its sha256 and bytes: the very bytes it sent)."""

    rows: list[int]
    source: Optional[str] = None
    file: Optional[str] = None
    sha256: Optional[str] = None
    bytes: Optional[int] = None


@dataclass
class DeltaMeta(Record):
    round: int
    base_round: int
    base_sha256: str
    global_sha256: str
    codec: str
    expert_files: dict[str, ExpertRef]
    merged: bool
    version: int = RECORD_VERSION


@dataclass
class RunIndex(Record):
    """Carried forward in every committed global's meta, so resume and retention read one manifest, not every
    round: the rounds a resume can start from from shared storage alone (every node's state checkpointed;
    round 0 always), oldest first."""

    storage_resumable: list[int] = field(default_factory=lambda: [0])


@dataclass
class Membership(Record):
    """Who trains what in the round built on a global: `owners` node id -> its experts (every expert has one
    owner; the baselines' members own them all), `slots` node id -> the share of the data it reads,
    `missed` node id -> rounds it has missed in a row (eviction counts them), `caps` (below)."""

    owners: dict[int, list[int]]
    slots: dict[int, int]
    missed: dict[int, int] = field(default_factory=dict)
    caps: dict[int, int] = field(default_factory=dict)
    """node id -> the most experts per layer that fit its memory (declared when it joined); absent: no cap."""

    @property
    def members(self) -> list[int]:
        return sorted(self.owners)

    def check_experts(self, num_experts: int, where: str) -> None:
        """Every expert has exactly one owner among the members (SPES), or every member owns them all (the
        baselines); every member has a data slot. A record edited or damaged otherwise would train on silently."""
        every = list(range(num_experts))
        owned = sorted(e for experts in self.owners.values() for e in experts)
        if not self.owners:
            raise RecordError(f"{where}: the membership has no members")
        if owned != every and any(sorted(experts) != every for experts in self.owners.values()):
            twice = sorted({e for e in owned if owned.count(e) > 1})
            none = sorted(set(every) - set(owned))
            odd = sorted(set(owned) - set(every))
            raise RecordError(f"{where}: the membership does not give each of the {num_experts} experts one owner "
                              f"(owned twice: {twice}, by nobody: {none}, not an expert: {odd}); the global is damaged")
        slotless = sorted(set(self.owners) - set(self.slots))
        if slotless:
            raise RecordError(f"{where}: the membership gives members {slotless} no data slot; the global is damaged")


@dataclass
class GlobalMeta(Record):
    round: int
    step: int
    model_config: dict
    method: str = ""
    source: str = ""
    contributors: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    merge_alpha: float = 0.0
    merged: bool = False
    node_loss: dict[int, float] = field(default_factory=dict)
    node_states: dict[int, StateRef] = field(default_factory=dict)
    codec: str = "fp32"
    seconds_aggregate: float = 0.0
    index: Optional[RunIndex] = None
    run_id: str = ""
    """The run's identity, carried in every global so a lost info bundle can be rebuilt (with `fingerprint`)."""
    total_steps: int = 0
    """The learning-rate schedule's horizon (sync.rounds x sync.every_steps) this global was trained with; 0 = unknown."""
    fingerprint: str = ""
    membership: Optional[Membership] = None
    """Who trains what in round `round`+1 (None: globals written before membership was round state, and
    round 0: the initial plan of the params, sync.num_nodes / sync.ownership)."""
    membership_changes: list[str] = field(default_factory=list)
    """What changed at this global (a node left, was evicted or joined; which experts moved), for people."""
    version: int = RECORD_VERSION

    def check(self, where: str) -> None:
        if self.membership is not None:
            self.membership.check_experts(int(self.model_config.get("num_experts", 0) or 0), where)


@dataclass
class RoundRecord(Record):
    round: int
    wall_s: float
    max_node_compute_s: float
    nodes: list[NodeReport]
    aggregate: GlobalMeta
    heldout_loss: Optional[float] = None
    heldout_s: float = 0.0
    tokens: int = 0
    version: int = RECORD_VERSION
    heldout_windows: Optional[list[float]] = None  # each window of the round's held-out slice (compare.round_pairs)
    metrics: dict[str, Optional[float]] = field(default_factory=dict)
    """The round's other measures of the committed global, by name (spes/round/driver.py's HeldOutProbe
    names them); records written before they existed read as none."""

    def to_json(self) -> dict:
        d = super().to_json()
        if d["heldout_loss"] is not None and not math.isfinite(d["heldout_loss"]):
            d["heldout_loss"] = None  # JSON has no NaN
        d["metrics"] = {k: v if v is not None and math.isfinite(v) else None for k, v in d["metrics"].items()}
        return d
