"""The objects a round works with, built once from the settings: the run on storage, the sync method and the
codec. The flow builds one per run (and holds it across rounds), a node process one per run it serves; every
step of a round takes it instead of the settings to rebuild them from.

The flow's context is the run's writer (it holds the run's lease): it keeps the global manifests it read or
committed, so the driver, the aggregator and retention share one read of global r-1 per round, and the
global the aggregator just committed is not read back at all. A node's context reads them fresh: a global
can be set aside and recomputed by the writer between two of its rounds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from spes.config.schema import Params
from spes.run.layout import RunLayout
from spes.run.run import Run
from spes.storage.store import Store
from spes.sync.codecs import Codec, make_codec
from spes.sync.method import SyncMethod
from spes.sync.methods import sync_method


@dataclass(frozen=True)
class RoundContext:
    p: Params
    run: Run
    method: SyncMethod
    codec: Codec

    @classmethod
    def build(cls, p: Params, run: str, store: Optional[Store] = None, writer: bool = False,
              role: str = "") -> "RoundContext":
        """`store`: an open one to share (a test's, a stage's); else opened from storage.*. `writer`: the
        flow holding the run's lease (see the module docstring). `role`: whose work, named when storage
        refuses a call ("orchestrator", "node machine")."""
        handle = Run(store, run, writer) if store is not None else Run.open(p.storage, run, writer, role)
        return cls(p, handle, sync_method(p), make_codec(p.sync.codec, p.sync.int8_block))

    @property
    def store(self) -> Store:
        return self.run.store

    @property
    def layout(self) -> RunLayout:
        return self.run.layout

    @property
    def name(self) -> str:
        return self.run.name
