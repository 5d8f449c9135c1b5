"""A node machine's folders of runs other than the one it trains: what a resume can still need of them, and
tidying the rest away (spes/run/node_state.py is one run's folder; this is the housekeeping across runs).

Storage decides: a folder whose run is gone or was started anew is removed; of a finished run only the
states a resume from a round still on storage needs stay (none when they are all checkpointed there); while a
run goes on, or when storage does not answer, nothing is removed.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from spes.config.schema import Params
from spes.run.node_state import NodeStateDir, node_folder
from spes.run.run import Run
from spes.storage.store import Store

log = logging.getLogger("spes.run.local_runs")


def node_state_root(p: Params) -> str:
    o = p.orchestration
    return os.path.expanduser(o.node_state_dir or os.path.join(o.node_cache_dir, "state"))


def open_node_state(p: Params, store: Store, run: str, run_id: str, node: int) -> NodeStateDir:
    """Node `node`'s folder of run `run` on this machine, keyed by the storage's exact location. A folder of
    the same run id kept under the former key (the storage URL as written) is moved into place once."""
    local = NodeStateDir(node_state_root(p), store.location, run, run_id, node)
    label = os.path.join(os.path.dirname(os.path.dirname(local.path)), "LOCATION")
    if not os.path.exists(label):  # which storage this folder's runs live on, for whoever looks at the disk
        with open(label, "w") as f:
            f.write(store.location + "\n")
    if local.adopt(node_folder(node_state_root(p), store.url, run, run_id, node)):
        log.info("node %d: moved its local state of run %s to %s (keyed by the storage location %s)", node, run,
                 local.path, store.location)
    return local


def local_states_to_keep(store: Store, name: str, id12: str, node: int,
                         window: Optional[int] = None) -> Optional[set[int]]:
    """Which of `node`'s local states of run `name` (run id starting `id12`) a resume can still need, by what
    storage says: none when the run is gone or was started anew; for a finished run (its last global, the
    schedule over, committed), the rounds of the states that the globals still on storage (with `window`,
    only the last `window` rounds: retention's, which may not have run yet) were built with and that are not
    checkpointed there; None (keep everything) while the run goes on, or when storage does not answer."""
    try:
        run = Run(store, name)
        info = run.info()
        if info is None:  # gone from storage (or never there): nothing to resume
            return set() if not run.committed_rounds() else None
        if not info["run_id"].startswith(id12):  # started anew under the same name
            return set()
        latest = run.latest_round()
        if latest is None:
            return None
        meta = run.global_meta(latest)
        if not (meta.total_steps and meta.step >= meta.total_steps):
            return None
        keep = set()
        for r in run.committed_rounds():
            if window is not None and r <= latest - window:
                continue
            ref = (meta if r == latest else run.global_meta(r)).node_states.get(node)
            if ref is not None and not run.has_checkpointed_state(node, ref):
                keep.add(ref.round)
        return keep
    except Exception:  # nothing is removed on doubt
        return None


def tidy_other_runs(p: Params, store: Store, local: NodeStateDir) -> list[str]:
    """This node's folders of other runs on this machine: removed when the run is gone or superseded; of a
    finished run only the states a resume from a round still on storage needs stay. What was tidied."""
    out = []
    for name, id12 in local.sibling_runs():
        keep = local_states_to_keep(store, name, id12, local.node)
        other = NodeStateDir(node_state_root(p), store.location, name, id12, local.node)
        if keep is not None and other.keep_only(keep):
            out.append(other.path)
    return out


_SWEPT: set = set()
"""(storage, run, run id, node) for which this process has tidied the node's folders of other runs."""


def tidy_other_runs_once(p: Params, store: Store, run: str, run_id: str, local: NodeStateDir) -> None:
    """tidy_other_runs, once per run and node process (not every round)."""
    key = (store.location, run, run_id, local.node)
    if key in _SWEPT:
        return
    for tidied in tidy_other_runs(p, store, local):
        log.info("node %d: tidied the local state of a superseded, finished or gone run: %s", local.node, tidied)
    _SWEPT.add(key)


def forget_finished_run(p: Params, store: Store, run: str, node: int) -> Optional[str]:
    """Once run `run` has finished: this machine keeps only the states of `node` a resume from a round still
    on storage needs (none when they are all checkpointed); its folder's path when it tidied it, else None."""
    info = Run(store, run).info()
    if info is None:
        return None
    local = open_node_state(p, store, run, info["run_id"], node)
    keep = local_states_to_keep(store, run, info["run_id"][:12], node, p.storage.keep_rounds)
    if keep is None or not os.path.isdir(local.path) or not local.keep_only(keep):
        return None
    return local.path
