"""A GPU machine's node host: the warm node processes of the nodes this machine runs, and the local door the
`spes-node` flow runs of this machine use to reach them.

`python -m pipelines.node_flow --nodes 0,1` starts one (then serves the nodes' deployments). A flow run
does not train: it hands the node's request to the host through a Unix socket (`SPES_NODE_HOST`), relays
the node's log lines and returns its report. The host runs the round on the node's long-lived
`pipelines.node_worker` process (torch imported once, not once per round), one round per node at a time
and at most `limit` rounds at once (one per GPU).
When the flow run goes away (cancelled by the orchestrator, killed), its connection closes and the host
kills the node's round: a straggler does not keep its GPU busy into the next round.

Wire format, one JSON object per line: the client sends a NodeRequest; the host answers with the round's
events as the node worker wrote them (pipelines/node_events.py: log and progress, then the result).
"""
from __future__ import annotations

import contextlib
import os
import select
import socket
import tempfile
import threading
from typing import Callable, Iterable, Optional

from pipelines.node_events import NodeEvent, read_stream, result_event
from pipelines.node_pool import NodePool
from pipelines.request import NodeRequest
from spes.errors import NodeFailed

HOST_ENV = "SPES_NODE_HOST"


def _closed(conn: socket.socket) -> bool:
    """Whether the peer closed the connection (readable with nothing to read)."""
    try:
        ready, _, _ = select.select([conn], [], [], 0)
        return bool(ready) and conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class NodeHost:
    """Serves node requests for `nodes` (None: any node) on a Unix socket, each on that node's warm process."""

    def __init__(self, nodes: Optional[Iterable[int]] = None, limit: Optional[int] = None):
        self.nodes = None if nodes is None else set(nodes)
        # rounds training at once on this machine (one per GPU): a flow run waiting here costs nothing
        self._slots = threading.BoundedSemaphore(limit) if limit else None
        # its node processes share this machine's cores among the rounds that run at once
        self.pool = NodePool(limit or (len(self.nodes) if self.nodes else None))
        self._locks: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()
        self.path = os.path.join(tempfile.mkdtemp(prefix="spes-node-host-"), "host.sock")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(16)
        threading.Thread(target=self._accept, name="spes-node-host", daemon=True).start()

    def start_workers(self) -> None:
        """Start the node processes now, so the first round does not wait for their interpreter and torch."""
        if self.nodes:
            self.pool.start(sorted(self.nodes))

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _node_lock(self, node: int) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(node, threading.Lock())

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("r", encoding="utf-8") as rf:
            def send(line: str) -> None:
                conn.sendall((line + "\n").encode())

            try:
                req = NodeRequest.from_line(rf.readline())
                if self.nodes is not None and req.node not in self.nodes:
                    raise NodeFailed(f"node {req.node} is not served by this host (it serves {sorted(self.nodes)})",
                                     retryable=False)
                with self._node_lock(req.node), (self._slots or contextlib.nullcontext()):
                    status, report = self.pool.get(req.node).run_round(
                        req, float("inf"), lambda event: send(event.line()), cancelled=lambda: _closed(conn))
                if status != "ok":
                    return  # the client is gone: nobody to answer
                out = result_event(report)
            except Exception as e:
                out = result_event(error=e)
            try:
                send(out.line())
            except OSError:
                pass

    def close(self) -> None:
        self._server.close()
        self.pool.close()
        try:
            os.unlink(self.path)
            os.rmdir(os.path.dirname(self.path))
        except OSError:
            pass


def host_round(path: str, req: NodeRequest, on_event: Callable[[NodeEvent], None],
               on_connect: Optional[Callable[[socket.socket], None]] = None):
    """The node's round through the host at `path`; its NodeReport, its log and progress events to
    `on_event`. Raises NodeFailed as the host reports it. `on_connect` gets the connection (shutting it
    down cancels the round)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        try:
            conn.connect(path)
        except OSError as e:
            raise NodeFailed(f"node {req.node}: no node host at {path} ({e})") from None
        if on_connect:
            on_connect(conn)
        conn.sendall((req.line() + "\n").encode())
        with conn.makefile("r", encoding="utf-8") as rf:
            return read_stream(rf, on_event, req.node, req.round, f"the node host at {path}")
