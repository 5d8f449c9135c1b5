"""Long-lived node processes on this machine, one per node, reused across rounds (see node_worker.py).

On Linux each node process is tied to its parent (PR_SET_PDEATHSIG): if the flow is killed, its nodes
die with it instead of finishing a round nobody waits for."""
from __future__ import annotations

import concurrent.futures
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

from pipelines.node_events import NodeEvent, relay_line
from pipelines.node_worker import NODES_HERE_ENV
from pipelines.request import NodeRequest
from spes.errors import NodeFailed
from spes.run.records import NodeReport

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the thread that started it dies (Linux; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# The death signal follows the *thread* that forked: fork from one thread that lives as long as the process,
# not from a task runner's worker thread that may exit while the node is still wanted.
_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="spes-node-spawner")


def spawn(args: list[str], **kwargs) -> subprocess.Popen:
    return _SPAWNER.submit(subprocess.Popen, args, preexec_fn=die_with_parent, **kwargs).result()


class NodeProcess:
    def __init__(self, node: int, nodes_here: Optional[int] = None):
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        if nodes_here:
            env[NODES_HERE_ENV] = str(nodes_here)
        self.node = node
        self.proc = spawn([sys.executable, "-m", "pipelines.node_worker"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)  # EOF: the process is gone

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run_round(self, req: NodeRequest, timeout_s: float, on_event: Callable[[NodeEvent], None],
                  cancelled: Optional[Callable[[], bool]] = None) -> tuple[str, Optional[NodeReport]]:
        """('ok', meta), ('timeout', None) or, when `cancelled()` turns true (checked every second),
        ('cancelled', None); the process is killed in both of the latter. The round's log and progress
        events go to `on_event` as they come. Raises NodeFailed if the process dies or the round errors."""
        try:
            self.proc.stdin.write(req.line() + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise NodeFailed(f"node {self.node}: worker process is gone (exit {self.proc.poll()})") from None
        deadline = time.time() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, min(1.0, deadline - time.time())))
            except queue.Empty:
                if cancelled is not None and cancelled():
                    self.kill()
                    return "cancelled", None
                if time.time() < deadline:
                    continue
                self.kill()
                return "timeout", None
            if line is None:
                rc = self.proc.wait()
                raise NodeFailed(f"node {self.node} round {req.round}: worker process died (exit {rc})")
            report = relay_line(line, on_event, self.node, req.round, f"node {self.node} worker")
            if report is not None:
                return "ok", report

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.alive():
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (subprocess.TimeoutExpired, OSError):
                self.kill()


class NodePool:
    """`nodes_here`: how many nodes share this machine's cores (a node host's); None: all of the run's nodes."""

    def __init__(self, nodes_here: Optional[int] = None):
        self._procs: dict[int, NodeProcess] = {}
        self._lock = threading.Lock()
        self.nodes_here = nodes_here

    def get(self, node: int) -> NodeProcess:
        with self._lock:
            p = self._procs.get(node)
            if p is None or not p.alive():
                p = self._procs[node] = NodeProcess(node, self.nodes_here)
            return p

    def start(self, nodes) -> None:
        """Start node processes ahead of use: their interpreter and torch start overlap the caller's setup."""
        for i in nodes:
            self.get(i)

    def __reduce__(self):
        # Prefect's runner pickles a served flow by value, globals included: unpickle to this process's pool
        return (process_pool, ())

    def close(self) -> None:
        with self._lock:
            for p in self._procs.values():
                p.close()
            self._procs.clear()


POOL = NodePool()


def process_pool() -> NodePool:
    return POOL
