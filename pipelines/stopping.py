"""Stopping the orchestrator on SIGTERM/SIGINT within seconds: node tasks give up, the node work they wait
for is cancelled (node processes here, node flow runs on other machines), and the flow unwinds, releasing
the run's lease on the way out. Executors register what is in flight and how to cancel it."""
from __future__ import annotations

import logging
import signal
import threading
from typing import Callable

from pipelines.node_pool import POOL
from spes.errors import NodeFailed

log = logging.getLogger("spes.pipelines")

STOPPING = threading.Event()
"""Set when the orchestrator is told to stop (SIGTERM/SIGINT): waiting node tasks give up at once."""
_IN_FLIGHT: dict[object, tuple[str, Callable[[], None]]] = {}
_IN_FLIGHT_LOCK = threading.Lock()


class Stopped(NodeFailed):
    """The orchestrator is stopping: the node's run was cancelled, nothing to retry."""

    def __init__(self, message: str):
        super().__init__(message, retryable=False)


def register(key, what: str, cancel: Callable[[], None]) -> None:
    """Work in flight (`what`, for the log) and how to cancel it."""
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT[key] = (what, cancel)


def unregister(key) -> None:
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.pop(key, None)


def cancel_in_flight() -> list[str]:
    """Stop every node task of this process and cancel what they wait for; returns what was cancelled."""
    STOPPING.set()
    POOL.close()  # process executor: its node processes end now
    with _IN_FLIGHT_LOCK:
        work = list(_IN_FLIGHT.values())
    for _, cancel in work:
        cancel()
    return [what for what, _ in work]


def stop_on_signals() -> None:
    """SIGTERM and SIGINT: cancel what is in flight, then unwind the flow (KeyboardInterrupt)."""

    def stop(signum, frame):
        cancelled = cancel_in_flight()
        log.warning("%s: stopping; cancelled %s", signal.Signals(signum).name, ", ".join(cancelled) or
                    "no node flow run")
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
