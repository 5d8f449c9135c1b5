"""A GPU machine's runner for its node deployments: claims their scheduled flow runs from the Prefect API and
runs each in this process, on a thread.

Prefect's own runner (`serve`) starts a fresh Python process for every flow run (imports of prefect and of
our flow, then the run); a node's round is one flow run, so that start-up was paid once per round, on the
cores the other node was training on. A `spes-node` flow run does no training itself (it hands the round to
the machine's warm node process, pipelines/node_host.py), so it can as well run here:

    register        the deployments (as `serve` does), returning their ids
    serve_forever   every `poll_s`: claim this machine's scheduled runs (Pending, as Prefect's runner does:
                    a run claimed by two machines goes to one), start each on a thread; cancel the ones the
                    orchestrator set to Cancelling (their round is killed through `cancel`)

Polling `get_scheduled_flow_runs` is also what marks the deployments READY on the server (and NOT_READY when
this machine stops polling), as for Prefect's runner.
"""
from __future__ import annotations

import datetime
import logging
import threading
from typing import Callable, Iterable
from uuid import UUID

log = logging.getLogger("spes.node_runner")


class NodeRunner:
    """Runs the flow runs of `deployments` (RunnerDeployments of one flow) in this process, at most `limit`
    at once; `cancel(flow_run_id)` stops a running one's work (the flow then ends)."""

    def __init__(self, flow, deployments: Iterable, poll_s: float, limit: int,
                 cancel: Callable[[UUID], None]):
        self.flow, self.deployments, self.poll_s, self.limit = flow, list(deployments), poll_s, limit
        self._cancel_work = cancel
        self.ids: list[UUID] = []
        self._active: set[UUID] = set()
        self._cancelled: set[UUID] = set()  # of the active ones
        self._lock = threading.Lock()

    def register(self) -> list[UUID]:
        self.ids = [d.apply() for d in self.deployments]
        return self.ids

    def serve_forever(self, stop: threading.Event) -> None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            while not stop.is_set():
                try:
                    self._cancel_requested(client)
                    self._claim(client)
                except Exception as e:  # the server restarting, a network blip: poll again
                    log.warning("node runner: polling the Prefect API failed: %s", e)
                stop.wait(self.poll_s)

    def _claim(self, client) -> None:
        from prefect.exceptions import Abort
        from prefect.states import Pending
        from prefect.utilities.engine import propose_state_sync

        soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=self.poll_s)
        for fr in client.get_scheduled_flow_runs_for_deployments(deployment_ids=self.ids, scheduled_before=soon):
            with self._lock:
                if fr.id in self._active or len(self._active) >= self.limit:
                    continue
            try:  # Pending first: of two runners that found it, one gets it
                if not propose_state_sync(client, Pending(), flow_run_id=fr.id).is_pending():
                    continue
            except Abort:
                continue
            with self._lock:
                self._active.add(fr.id)
            threading.Thread(target=self._run, args=(fr,), name=f"spes-node-run-{fr.name}", daemon=True).start()

    def _run(self, fr) -> None:
        from prefect.flow_engine import run_flow

        try:  # its state (Running, Completed or Failed) the engine reports to the API itself
            run_flow(self.flow, flow_run=fr, parameters=fr.parameters, return_type="state")
        except BaseException as e:  # never takes the runner down
            log.warning("node runner: flow run %s ended with %r", fr.name, e)
        finally:
            with self._lock:
                self._active.discard(fr.id)
                cancelled = fr.id in self._cancelled
                self._cancelled.discard(fr.id)
            if cancelled:
                self._mark_cancelled(fr.id)

    def _cancel_requested(self, client) -> None:
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterId,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        from prefect.client.schemas.objects import StateType

        with self._lock:
            active = [i for i in self._active if i not in self._cancelled]
        if not active:
            return
        for fr in client.read_flow_runs(flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=active),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CANCELLING])))):
            with self._lock:
                self._cancelled.add(fr.id)
            log.info("node runner: cancelling flow run %s", fr.name)
            self._cancel_work(fr.id)

    @staticmethod
    def _mark_cancelled(flow_run_id: UUID) -> None:
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelled

        try:
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(flow_run_id, Cancelled(message="cancelled by the orchestrator"), force=True)
        except Exception as e:
            log.warning("node runner: could not mark flow run %s cancelled: %s", flow_run_id, e)
