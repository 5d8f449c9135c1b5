"""A progress artifact per round in the Prefect UI: the mean over the round's nodes of the share of their
local steps done, fed by the nodes' progress lines (process executor) or their heartbeats (deployments).

    RoundProgress.start(key, run, r, nodes)   at the round's start (round task)
    RoundProgress.of(run, r)                  the node tasks' handle on it (None outside a round)
    .node_done(node, share)                   a node's share of its steps done; the artifact is written at
                                              most every MIN_GAP_S (or at once with force)
"""
import threading
import time
from typing import Optional

MIN_GAP_S = 1.0
"""Seconds between two writes of the artifact (an API call each): enough to watch, cheap for the server."""

_ROUNDS: dict = {}
_LOCK = threading.Lock()


class RoundProgress:
    def __init__(self, key: str, r: int, nodes: int):
        from prefect.artifacts import create_progress_artifact

        self.nodes, self.done = nodes, {}
        self._lock, self._written, self._last = threading.Lock(), 0.0, -1.0
        self.id = create_progress_artifact(progress=0.0, key=key,
                                           description=f"Round {r}: local steps done, mean over its {nodes} nodes")

    @classmethod
    def start(cls, key: str, run: str, r: int, nodes: int) -> "RoundProgress":
        progress = cls(key, r, nodes)
        with _LOCK:
            _ROUNDS.clear()  # one round at a time per flow process
            _ROUNDS[(run, r)] = progress
        return progress

    @staticmethod
    def of(run: str, r: int) -> Optional["RoundProgress"]:
        with _LOCK:
            return _ROUNDS.get((run, r))

    def node_done(self, node: int, share: float, force: bool = False) -> None:
        with self._lock:
            self.done[node] = min(1.0, share)
            value = 100.0 * sum(self.done.values()) / self.nodes
            if value == self._last or (not force and time.monotonic() - self._written < MIN_GAP_S):
                return
            self._written, self._last = time.monotonic(), value
        try:
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self.id, value)
        except Exception:  # a progress bar is not worth failing a round
            pass
