"""The deployment executor: a node's round as a flow run of its `spes-node` deployment, served by the machine
that holds the node (pipelines/node_flow.py), watched through the Prefect API and the node's heartbeat on
shared storage (spes/run/heartbeat.py).

    check_node_deployments   before any round: an API the node machines can reach, each node's deployment
                             with a live runner
    run_on_deployment        one node's round: create the flow run, wait for its committed upload; a node
                             silent for heartbeat_timeout_s is lost (NodeLost: cancelled, retried by the node
                             task, on the spare deployment when its state allows)
"""

# No `from __future__ import annotations` here: Prefect's runner pickles a served flow by value, and
# its parameter annotations must resolve as objects in the child process.
import os
import time
from typing import Optional

from prefect import get_run_logger

from pipelines import stopping
from pipelines.prefect_api import TEMPORARY_API_ENV
from pipelines.request import NodeRequest
from pipelines.round_progress import RoundProgress
from spes.config.loader import to_dict
from spes.config.schema import Params
from spes.errors import NodeFailed
from spes.round.context import RoundContext
from spes.round.node import committed_report
from spes.round.progress_line import progress_of
from spes.run.heartbeat import HeartbeatWatch
from spes.run.records import NodeReport
from spes.run.run import Run

log = stopping.log

POLL_S, WAITING_LOG_S = 0.25, 10.0
"""How often the orchestrator looks at a node's flow run (an API read, not storage: storage is read for the
heartbeat every timeout/4 and for the upload once the run ends, so its reads do not grow with a round's
length). A node run not started after WAITING_LOG_S seconds is logged once as waiting for its runner."""

_LOST: set = set()
"""(run, round, node) whose machine was lost in that round (this process)."""
_MOVED: set = set()
"""(run, node) that now runs on the spare deployment (this process)."""


class NodeLost(NodeFailed):
    """A deployment node whose heartbeat stopped: retried (on the spare deployment if its state allows)."""

    def __init__(self, message: str):
        super().__init__(message, retryable=True)


def node_deployment(template: str, node) -> str:
    return template.replace("{node}", str(node))


def run_on_deployment(ctx: RoundContext, r: int, node: int, timeout_s: float, checkpoint: bool,
                      tokens_key: Optional[str]) -> tuple[str, Optional[NodeReport]]:
    """Node `node`'s round as a flow run of its deployment; after its machine was lost (this round, or it moved
    earlier), on the spare deployment: with its state from shared storage (the checkpoint its global names,
    else its latest checkpoint: an older optimizer state and data position, and the run says so)."""
    p, run, store_run = ctx.p, ctx.name, ctx.run
    target, from_checkpoint = None, False
    if p.orchestration.spare_deployment and (run, r, node) in _LOST:
        target = p.orchestration.spare_deployment
        ref = store_run.global_meta(r - 1).node_states.get(node)
        from_checkpoint = ref is not None and not ref.checkpoint
        if from_checkpoint:
            k, _ = store_run.last_checkpointed_state(node, ref.round)
            where = (f"its state after round {ref.round} was on the lost machine: from its checkpoint of round {k}, "
                     "an older optimizer state and data position")
        else:
            where = f"its state from the checkpoint of round {ref.round}" if ref else "new: its first round"
        get_run_logger().warning("node %d round %d: its machine was lost; retrying it on %s (%s)", node, r, target,
                                 where)
    elif (run, node) in _MOVED:  # its state is on the spare now
        target = p.orchestration.spare_deployment
    try:
        status, report = _run_flow_run(ctx, r, node, timeout_s, checkpoint, tokens_key, target, from_checkpoint)
    except NodeLost:
        _LOST.add((run, r, node))
        _MOVED.discard((run, node))  # a lost spare: its own machine first again
        raise
    if target is not None:
        _MOVED.add((run, node))  # later rounds go to the spare directly: its state is there now
    return status, report


def _run_flow_run(ctx: RoundContext, r: int, node: int, timeout_s: float, checkpoint: bool,
                         tokens_key: Optional[str], target: Optional[str] = None,
                         from_checkpoint: bool = False) -> tuple[str, Optional[NodeReport]]:
    """Real clusters: the node runs as a flow run of its deployment, served by the machine that holds it (see
    pipelines/node_flow.py), reading the token shards published to shared storage under `tokens_key`. Its
    result reaches us through storage (the node's committed upload), the one channel both sides share. While
    it runs, its heartbeat on storage must keep changing: a node silent for heartbeat_timeout_s (its machine
    dead, or nobody serving its deployment) is lost: its flow run is cancelled and NodeFailed raised."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import task_run

    p, run, store = ctx.p, ctx.name, ctx.store
    o = p.orchestration
    name = target or node_deployment(o.node_deployment, node)
    params = NodeRequest(to_dict(p), run, r, node, checkpoint, tokens_key,
                         from_checkpoint=from_checkpoint).deployment_parameters()
    with get_client(sync_client=True) as client:
        # the client's own call, not run_deployment: that one took up to 6 s per node under concurrent tasks
        fr = client.create_flow_run_from_deployment(client.read_deployment_by_name(name).id, parameters=params,
                                                    name=f"{run}-node-{node}-round-{r}",
                                                    parent_task_run_id=task_run.id)  # shown under its node task
        stopping.register(fr.id, f"node {node} round {r}", lambda: _cancel_flow_run(fr.id, _state_of(fr.id)))
        watch, deadline = HeartbeatWatch(store, run, r, node), time.time() + timeout_s
        progress = RoundProgress.of(run, r)
        beat_every, next_beat = o.heartbeat_timeout_s / 4, 0.0
        t0, waiting_logged = time.monotonic(), False
        try:
            while True:
                state = client.read_flow_run(fr.id).state
                if state is not None and state.is_final():
                    break
                if stopping.STOPPING.is_set():
                    _cancel_flow_run(fr.id, state)
                    raise stopping.Stopped(f"node {node} round {r}: the orchestrator is stopping; its flow run was cancelled")
                if time.time() >= deadline:
                    _cancel_flow_run(fr.id, state)  # a straggler must not keep its GPU busy into the next round
                    return "timeout", None
                if time.monotonic() >= next_beat:
                    watch.poll()
                    if progress is not None and watch.progress is not None:
                        progress.node_done(node, watch.progress, progress_of(watch.event))
                    next_beat = time.monotonic() + beat_every
                    if not waiting_logged and not (state and state.is_running()) and \
                            time.monotonic() - t0 > min(WAITING_LOG_S, o.heartbeat_timeout_s / 2):
                        waiting_logged = _log_waiting(node, r, name, state, time.monotonic() - t0, o.heartbeat_timeout_s)
                if watch.silent_s() > o.heartbeat_timeout_s:
                    _cancel_flow_run(fr.id, state)
                    raise NodeLost(f"node {node} round {r}: lost: no heartbeat for {watch.silent_s():.0f} s "
                                   f"(orchestration.heartbeat_timeout_s) from {name}, its flow run "
                                   f"{state.name if state else 'not started'}; cancelled it")
                time.sleep(POLL_S)
        finally:
            stopping.unregister(fr.id)
    return "ok", _final_report(ctx.run, r, node, state)


def _log_waiting(node: int, r: int, name: str, state, waited_s: float, lost_after_s: float) -> bool:
    """Say once that nobody has picked up the node's flow run yet (its machine down, or not serving)."""
    get_run_logger().warning("node %d round %d: waiting for a runner of %s (its flow run %s for %.0f s; lost after "
                             "%.0f s without a heartbeat)", node, r, name, state.name if state else "not scheduled",
                             waited_s, lost_after_s)
    return True


def _final_report(run: Run, r: int, node: int, state) -> NodeReport:
    """The node's committed report once its flow run ended: NodeFailed with the node's own error otherwise."""
    if not state.is_completed():
        why = f": {state.message}" if state.message else ""  # the node's own error, as its flow run reported it
        raise NodeFailed(f"node {node} round {r}: deployment run ended {state.name}{why}")
    report = committed_report(run, r, node)
    if report is None:
        raise NodeFailed(f"node {node} round {r}: its deployment run completed but no upload is committed")
    return report


def _cancel_flow_run(flow_run_id, state=None) -> None:
    """Cancel a node's flow run: a running one through its runner (CANCELLING: the runner kills it), one that
    never started at once (CANCELLED: there may be no runner left to act on it)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Cancelling

    started = state is not None and state.is_running()
    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Cancelling() if started else Cancelled(), force=True)
    except Exception as e:  # the round goes on without the node either way
        log.warning("could not cancel node flow run %s: %s", flow_run_id, e)


def _state_of(flow_run_id):
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            return client.read_flow_run(flow_run_id).state
    except Exception:
        return None


def check_node_deployments(p: Params, nodes) -> None:
    """Before any round (executor deployment): a Prefect API the node machines can reach, and each node's
    deployment there with a live runner; one line naming what is missing. `nodes`: the run's current members
    (the initial plan's before round 1)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    if os.environ.get(TEMPORARY_API_ENV):
        raise NodeFailed("orchestration.executor is deployment, but PREFECT_API_URL is not set: node machines cannot "
                         "reach this process's temporary Prefect server; start one (prefect server start --host "
                         "0.0.0.0) and export PREFECT_API_URL=http://<this machine>:4200/api here and on every "
                         "node machine", retryable=False)
    names = sorted({node_deployment(p.orchestration.node_deployment, i) for i in nodes})
    missing, idle = [], []
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                d = client.read_deployment_by_name(name)
            except ObjectNotFound:
                missing.append(name)
                continue
            if str(getattr(d, "status", "READY")).upper().endswith("NOT_READY"):
                idle.append(name)
    if missing or idle:
        parts = ([f"no deployment {', '.join(missing)}"] if missing else []) + \
                ([f"no live runner for {', '.join(idle)}"] if idle else [])
        raise NodeFailed(f"orchestration.executor is deployment: {'; '.join(parts)} on {os.environ.get('PREFECT_API_URL')}"
                         " (on each node machine: python -m pipelines.node_flow --nodes <its nodes>)", retryable=False)
