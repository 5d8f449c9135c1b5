"""Fault injection for tests, parsed in one place: `SPES_FAULT_PLAN` (JSON) in the environment of a node
process (`pipelines/node_worker.py`) or of a `spes-node` deployment worker (`pipelines/node_flow.py`):

  {"kill": {"round": 2, "node": 1, "after_step": 3}}   SIGKILL once (a marker file makes it fire once)
  {"slow": {"round": 2, "node": 1, "seconds": 5}}        sleep before every step (a straggler)
  {"corrupt": {"round": 2, "node": 0}}                   truncate the node's committed upload once
  {"poison": {"round": 2, "node": 0, "scale": 1000}}     rewrite its committed shared delta once, scaled
                                                         (or "nan": true: NaN-filled), manifest and COMMIT
                                                         made to match: bytes that verify, values that do not
  {"dead": {"node": 2, "from_round": 3}}                 SIGKILL at the first step of every try from that round
                                                         on (a machine gone for good)

each optionally limited to one run with "run": "<name>".
"""
from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from typing import Callable, Optional

from spes.errors import ConfigError

ENV = "SPES_FAULT_PLAN"
KINDS = ("kill", "slow", "corrupt", "poison", "dead")


class FaultPlan:
    def __init__(self, plan: dict):
        unknown = set(plan) - set(KINDS)
        if unknown:
            raise ConfigError(f"{ENV}: unknown fault kinds {sorted(unknown)} (known: {', '.join(KINDS)})")
        self.plan = plan

    @classmethod
    def from_env(cls) -> "FaultPlan":
        try:
            return cls(json.loads(os.environ.get(ENV, "") or "{}"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{ENV} is not valid JSON: {e}") from None

    def _applies(self, kind: str, run: str, r: int, node: int) -> Optional[dict]:
        f = self.plan.get(kind)
        if f and f["round"] == r and f["node"] == node and f.get("run", run) == run:
            return f
        return None

    @staticmethod
    def _once(what: str) -> bool:
        """True the first time per parent process (the flow, or the node-flow worker): a marker beside it."""
        marker_dir = os.path.join(tempfile.gettempdir(), f"spes-faults-{os.getppid()}")
        marker = os.path.join(marker_dir, what)
        if os.path.exists(marker):
            return False
        os.makedirs(marker_dir, exist_ok=True)
        open(marker, "w").close()
        return True

    def hook(self, run: str, r: int, node: int) -> Optional[Callable[[int], None]]:
        """A per-step callback for a NodeRound, or None when nothing applies to this node and round."""
        kill, slow = self._applies("kill", run, r, node), self._applies("slow", run, r, node)
        dead = self.plan.get("dead")
        dead = dead if dead and dead["node"] == node and r >= dead["from_round"] and dead.get("run", run) == run else None
        if not (kill or slow or dead):
            return None

        def on_step(i: int) -> None:
            if dead:
                os.kill(os.getpid(), signal.SIGKILL)
            if kill and i == kill.get("after_step", 0) and self._once(f"killed-{run}-r{r}-n{node}"):
                os.kill(os.getpid(), signal.SIGKILL)
            if slow:
                time.sleep(float(slow["seconds"]))

        return on_step

    def after_commit(self, run: str, r: int, node: int, upload_dir: str) -> None:
        """Damage the node's committed upload (local storage), once: the aggregator must catch it."""
        if self._applies("corrupt", run, r, node) and self._once(f"corrupt-{run}-r{r}-n{node}"):
            f = os.path.join(upload_dir, "shared.safetensors")
            with open(f, "r+b") as fh:
                fh.truncate(os.path.getsize(f) - 64)
        poison = self._applies("poison", run, r, node)
        if poison and self._once(f"poison-{run}-r{r}-n{node}"):
            poison_upload(upload_dir, float(poison.get("scale", 1.0)), bool(poison.get("nan", False)))


def poison_upload(upload_dir: str, scale: float, nan: bool, fname: Optional[str] = None) -> None:
    """Rewrite a committed upload's shared delta (or its file `fname`; local storage) scaled or NaN-filled, its
    manifest and COMMIT made to match: what a misbehaving node could commit, which no checksum catches."""
    import torch

    from spes.storage.store import Store
    from spes.sync.deltas import SHARED_FILE

    store, rel = Store(os.path.dirname(upload_dir), retries=0), os.path.basename(upload_dir)
    b = store.read_bundle(rel)
    files, fname = dict(b.files), fname or SHARED_FILE
    files[fname] = {k: (torch.full_like(t, float("nan")) if nan else t * scale) if t.is_floating_point() else t
                    for k, t in b.files[fname].items()}
    store.remove(rel)
    store.write_bundle(rel, files, b.meta)
