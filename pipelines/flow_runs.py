"""What one training flow run works with, built once where it starts, and the one registry its tasks find
it in by the flow run they belong to (not by comparing settings).

    FlowRunSession  the run's context as its writer, the aggregator (it holds the global it committed last
                    for the next round), and the executor that runs the nodes
    FLOW_RUNS       flow run id -> its session; a task called outside a flow (a test's) has its own entry

Two flow runs in one process (a served deployment runs each in a process of its own; tests and `dvc exp run`
may not) each find their own session.
"""

# No `from __future__ import annotations` here: Prefect's runner pickles a served flow by value, and
# its parameter annotations must resolve as objects in the child process.
import threading
from dataclasses import dataclass
from typing import Optional

from pipelines.executors import NodeExecutor, executor_for
from spes.config.schema import Params
from spes.round.aggregator import Aggregator
from spes.round.context import RoundContext


@dataclass
class FlowRunSession:
    ctx: RoundContext
    aggregator: Aggregator
    node_executor: NodeExecutor


def _current_flow_run() -> Optional[str]:
    """The id of the flow run the calling flow or task belongs to (None outside one)."""
    from prefect.context import FlowRunContext, TaskRunContext

    task = TaskRunContext.get()
    if task is not None and task.task_run.flow_run_id is not None:
        return str(task.task_run.flow_run_id)
    flow = FlowRunContext.get()
    return str(flow.flow_run.id) if flow is not None and flow.flow_run is not None else None


class FlowRuns:
    """The registry of the sessions of the flow runs in this process."""

    def __init__(self) -> None:
        self._sessions: dict[Optional[str], FlowRunSession] = {}
        self._lock = threading.Lock()

    def open(self, p: Params, run: str, executor: Optional[NodeExecutor] = None) -> FlowRunSession:
        """At a flow run's start: the run's context as its writer, its aggregator and executor (what another
        process did to the run since an earlier session is read anew)."""
        ctx = RoundContext.build(p, run, writer=True, role="orchestrator")
        session = FlowRunSession(ctx, Aggregator(ctx), executor if executor is not None else executor_for(p))
        with self._lock:
            self._sessions[_current_flow_run()] = session
        return session

    def current(self, p: Params, run: str) -> FlowRunSession:
        """The session of the calling task's flow run; a task called outside a flow (or a flow run that did not
        open one) opens it here, for `run` with settings `p`."""
        key = _current_flow_run()
        with self._lock:
            session = self._sessions.get(key)
        if session is None or session.ctx.name != run or (key is None and session.ctx.p != p):
            session = self.open(p, run)
        return session

    def __reduce__(self):
        # Prefect's runner pickles a served flow by value, globals included: unpickle to that process's registry
        return (registry, ())

    def close(self) -> None:
        """At the flow run's end: its session is let go (the executor is closed by the flow)."""
        with self._lock:
            self._sessions.pop(_current_flow_run(), None)


FLOW_RUNS = FlowRuns()
"""The one registry of flow-run sessions (module-level by design: tasks run on Prefect's threads and find
their flow run's objects here)."""


def registry() -> FlowRuns:
    return FLOW_RUNS
