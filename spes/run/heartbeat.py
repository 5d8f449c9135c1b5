"""A node's heartbeat on shared storage, so that the orchestrator notices a dead machine in seconds.

While a node works on a round on another machine (the deployment executor), that machine rewrites
`runs/<run>/heartbeats/<node>.json` every `interval_s` with a counter that only grows. The orchestrator
reads it now and then and declares the node lost when the content has not changed for `timeout_s` by its
own clock: no clock is compared across machines, so skew does not matter.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Optional

from spes.errors import SpesError
from spes.run.layout import RunLayout
from spes.storage.files import FileStore

log = logging.getLogger("spes.run.heartbeat")


class Heartbeat:
    """Writes the node's heartbeat every `interval_s` from a daemon thread while in use (`with Heartbeat(...)`)."""

    def __init__(self, store: FileStore, run: str, r: int, node: int, interval_s: float):
        self.store, self.rel = store, RunLayout(run).heartbeat(node)
        self.r, self.node, self.interval_s = r, node, interval_s
        self.beat = 0
        self.progress: Optional[float] = None
        """Share of the round's local steps done, when the node reports it (shown in the round's progress)."""
        self.event: Optional[dict] = None
        """The node's last progress event as fields (steps done, loss, tokens, seconds), for the round's view."""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def write(self) -> None:
        self.beat += 1
        body = {"round": self.r, "node": self.node, "beat": self.beat, "host": socket.gethostname(), "pid": os.getpid(),
                "progress": self.progress, "event": self.event}
        try:
            self.store.write_bytes(self.rel, json.dumps(body).encode())
        except (SpesError, OSError) as e:  # a missed beat is not a failed round; a long silence will be noticed
            log.warning("node %d: heartbeat not written (%s)", self.node, e)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write()

    def __enter__(self) -> "Heartbeat":
        self.write()
        self._thread = threading.Thread(target=self._loop, name=f"spes-heartbeat-{self.node}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)


class HeartbeatWatch:
    """The orchestrator's view of one node's heartbeat for round r: `silent_s()` = seconds (by this machine's
    clock) since the heartbeat last changed, or since the watch started if it never did."""

    def __init__(self, store: FileStore, run: str, r: int, node: int):
        self.store, self.rel, self.r = store, RunLayout(run).heartbeat(node), r
        self._last: Optional[bytes] = None
        self._changed = time.monotonic()
        self.progress: Optional[float] = None
        """The node's share of the round's local steps done, as its last heartbeat said."""
        self.event: Optional[dict] = None
        """The node's last progress event as its heartbeat carried it (fields, unchecked), or None."""

    def poll(self) -> None:
        try:
            body = self.store.read_bytes(self.rel)
        except (SpesError, OSError):  # not written yet, or storage did not answer: no news
            return
        try:
            beat = json.loads(body)
            if beat.get("round") != self.r:  # a beat of an earlier round says nothing about this one
                return
        except (ValueError, AttributeError):
            return
        if isinstance(beat.get("progress"), (int, float)):
            self.progress = float(beat["progress"])
        if isinstance(beat.get("event"), dict):
            self.event = beat["event"]
        if body != self._last:
            self._last, self._changed = body, time.monotonic()

    def silent_s(self) -> float:
        return time.monotonic() - self._changed
