"""A progress artifact per round in the Prefect UI: the bar is the mean over the round's nodes of the share of
their local steps done; its description is a table of each node's steps done, last loss and tokens/s. Fed
by the nodes' progress events (process executor) or their heartbeats (deployments).

    RoundProgress.start(key, run, r, nodes)   at the round's start (round task)
    RoundProgress.of(run, r)                  the node tasks' handle on it (None outside a round)
    .node_done(node, share, event)            a node's share of its steps done and its last progress event;
                                              the artifact is written at most every MIN_GAP_S (or at once
                                              with force)
"""
import threading
import time
from typing import Optional

from spes.round.progress_line import Progress

MIN_GAP_S = 1.0
"""Seconds between two writes of the artifact (an API call each): enough to watch, cheap for the server."""

_ROUNDS: dict = {}
_LOCK = threading.Lock()


class RoundProgress:
    def __init__(self, key: str, r: int, nodes: int):
        from prefect.artifacts import create_progress_artifact

        self.r, self.nodes, self.done, self.events = r, nodes, {}, {}
        self._lock, self._written, self._last = threading.Lock(), 0.0, ""
        self.id = create_progress_artifact(progress=0.0, key=key, description=self.describe())

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

    def percent(self) -> float:
        return 100.0 * sum(self.done.values()) / self.nodes

    def describe(self) -> str:
        """The artifact's description: the bar's meaning, then one row per node that reported."""
        lines = [f"Round {self.r}: local steps done, mean over its {self.nodes} nodes"]
        if self.done:
            lines += ["", "| node | local steps done | last loss | tokens/s |", "|---|---|---|---|"]
            for node in sorted(self.done):
                ev = self.events.get(node)
                if ev is None:
                    lines.append(f"| {node} | {100 * self.done[node]:.0f}% | - | - |")
                else:
                    rate = ev.tokens / ev.seconds if ev.seconds > 0 else 0.0
                    lines.append(f"| {node} | {ev.done}/{ev.steps} | {ev.loss:.4f} | {rate:,.0f} |")
        return "\n".join(lines)

    def node_done(self, node: int, share: float, event: Optional[Progress] = None, force: bool = False) -> None:
        with self._lock:
            self.done[node] = min(1.0, share)
            if event is not None:
                self.events[node] = event
            value, description = self.percent(), self.describe()
            if description == self._last or (not force and time.monotonic() - self._written < MIN_GAP_S):
                return
            self._written, self._last = time.monotonic(), description
        try:
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self.id, value, description=description)
        except Exception:  # a progress bar is not worth failing a round
            pass
