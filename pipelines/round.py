"""One sync round as Prefect tasks, around the library's round driver (spes/round/driver.py):

    round-<r> (task)              run_round: fans out one node task per node, then aggregates; held-out loss
                                  of the new global; the round record; storage retention
      node-<i>-round-<r> (task)   a node process here, or a `spes-node` deployment on a GPU machine; retried
      aggregate-round-<r> (task)  quorum of verified uploads -> committed delta + global model (retried: an
                                  uncommitted attempt is redone whole); an upload that fails verification is
                                  set aside and its node re-run once

Tasks receive the parsed, validated `Params` from the flow (nothing is re-read from disk). A table
artifact per round (node, loss, tokens, bytes up/down, seconds, expert load) shows in the Prefect UI.
"""

# No `from __future__ import annotations` here: Prefect's runner pickles a served flow by value, and
# its parameter annotations must resolve as objects in the child process.
import logging
import re
import threading
import time
from typing import Any, Optional

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.futures import wait

from pipelines.formatting import fmt_balance, fmt_bytes, fmt_loss, fmt_seconds
from pipelines.node_pool import POOL
from pipelines.prefect_api import TEMPORARY_API_ENV
from pipelines.request import NodeRequest
from spes.config.loader import to_dict
from spes.config.schema import Params
from spes.errors import NodeFailed, retryable
from spes.round.aggregator import Aggregator
from spes.round.driver import HeldOutProbe, run_round
from spes.round.node import committed_report
from spes.run.heartbeat import HeartbeatWatch
from spes.run.records import GlobalMeta, NodeReport, RoundRecord
from spes.run.run import Run
from spes.storage.store import Store
from spes.sync.methods import sync_method


def artifact_key(*parts: Any) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(str(p) for p in parts).lower()).strip("-")


# -- node executors ----------------------------------------------------------------------------------
def _run_node_process(p: Params, run: str, r: int, node: int, timeout_s: float,
                      checkpoint: bool) -> tuple[str, Optional[NodeReport]]:
    """Run the round on the node's long-lived process, relaying its output to the Prefect log."""
    logger = get_run_logger()
    req = NodeRequest(to_dict(p), run, r, node, checkpoint)
    status, report = POOL.get(node).run_round(req, timeout_s, lambda line: logger.info("node %d | %s", node, line),
                                              cancelled=STOPPING.is_set)
    if status == "cancelled":
        raise Stopped(f"node {node} round {r}: the orchestrator is stopping")
    return status, report


POLL_S, COMMIT_POLL_S, WAITING_LOG_S = 0.25, 0.25, 10.0
"""How often the orchestrator looks at a node's flow run (a cheap API read) and, while it runs, for its
committed upload on storage (one small read); heartbeats: every timeout/4. A node run not started after
WAITING_LOG_S seconds is logged once as waiting for its runner."""

STOPPING = threading.Event()
"""Set when the orchestrator is told to stop (SIGTERM/SIGINT): waiting node tasks give up at once."""
_IN_FLIGHT: dict = {}
_IN_FLIGHT_LOCK = threading.Lock()


_LOST: set = set()
"""(run, round, node) whose machine was lost in that round (this process)."""
_MOVED: set = set()
"""(run, node) that now runs on the spare deployment (this process)."""


class NodeLost(NodeFailed):
    """A deployment node whose heartbeat stopped: retried (on the spare deployment if its state allows)."""

    def __init__(self, message: str):
        super().__init__(message, retryable=True)


class Stopped(NodeFailed):
    """The orchestrator is stopping: the node's run was cancelled, nothing to retry."""

    def __init__(self, message: str):
        super().__init__(message, retryable=False)


def node_deployment(template: str, node) -> str:
    return template.replace("{node}", str(node))


def _run_node_deployment(p: Params, run: str, r: int, node: int, timeout_s: float, checkpoint: bool,
                         tokens_key: Optional[str], target: Optional[str] = None) -> tuple[str, Optional[NodeReport]]:
    """Real clusters: the node runs as a flow run of its deployment, served by the machine that holds it (see
    pipelines/node_flow.py), reading the token shards published to shared storage under `tokens_key`. Its
    result reaches us through storage (the node's committed upload), the one channel both sides share. While
    it runs, its heartbeat on storage must keep changing: a node silent for heartbeat_timeout_s (its machine
    dead, or nobody serving its deployment) is lost: its flow run is cancelled and NodeFailed raised."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import task_run

    o = p.orchestration
    name = target or node_deployment(o.node_deployment, node)
    store = Store.from_config(p.storage)
    params = NodeRequest(to_dict(p), run, r, node, checkpoint, tokens_key).deployment_parameters()
    with get_client(sync_client=True) as client:
        # the client's own call, not run_deployment: that one took up to 6 s per node under concurrent tasks
        fr = client.create_flow_run_from_deployment(client.read_deployment_by_name(name).id, parameters=params,
                                                    name=f"{run}-node-{node}-round-{r}",
                                                    parent_task_run_id=task_run.id)  # shown under its node task
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT[fr.id] = f"node {node} round {r}"
        watch, deadline = HeartbeatWatch(store, run, r, node), time.time() + timeout_s
        beat_every, next_beat, next_commit = o.heartbeat_timeout_s / 4, 0.0, 0.0
        t0, waiting_logged = time.monotonic(), False
        try:
            while True:
                state = client.read_flow_run(fr.id).state
                if state is not None and state.is_final():
                    break
                if state is not None and state.is_running() and time.monotonic() >= next_commit:
                    # the upload is what counts: no need to wait for the flow run to wind down and report
                    report = committed_report(store, run, r, node)
                    if report is not None:
                        return "ok", report
                    next_commit = time.monotonic() + COMMIT_POLL_S
                if STOPPING.is_set():
                    _cancel_flow_run(fr.id, state)
                    raise Stopped(f"node {node} round {r}: the orchestrator is stopping; its flow run was cancelled")
                if time.time() >= deadline:
                    _cancel_flow_run(fr.id, state)  # a straggler must not keep its GPU busy into the next round
                    return "timeout", None
                if time.monotonic() >= next_beat:
                    watch.poll()
                    next_beat = time.monotonic() + beat_every
                    if not waiting_logged and not (state and state.is_running()) and \
                            time.monotonic() - t0 > min(WAITING_LOG_S, o.heartbeat_timeout_s / 2):
                        waiting_logged = True
                        get_run_logger().warning(
                            "node %d round %d: waiting for a runner of %s (its flow run %s for %.0f s; lost after "
                            "%.0f s without a heartbeat)", node, r, name, state.name if state else "not scheduled",
                            time.monotonic() - t0, o.heartbeat_timeout_s)
                if watch.silent_s() > o.heartbeat_timeout_s:
                    _cancel_flow_run(fr.id, state)
                    raise NodeLost(f"node {node} round {r}: lost: no heartbeat for {watch.silent_s():.0f} s "
                                   f"(orchestration.heartbeat_timeout_s) from {name}, its flow run "
                                   f"{state.name if state else 'not started'}; cancelled it")
                time.sleep(POLL_S)
        finally:
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.pop(fr.id, None)
    if not state.is_completed():
        raise NodeFailed(f"node {node} round {r}: deployment run ended {state.name}")
    report = committed_report(store, run, r, node)
    if report is None:
        raise NodeFailed(f"node {node} round {r}: its deployment run completed but no upload is committed")
    return "ok", report


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
        logging.getLogger("spes.pipelines").warning("could not cancel node flow run %s: %s", flow_run_id, e)


def cancel_in_flight() -> list[str]:
    """Stop every node task of this process and cancel the node flow runs it waits for (on SIGTERM/SIGINT);
    returns what was cancelled."""
    STOPPING.set()
    POOL.close()  # process executor: its node processes end now
    with _IN_FLIGHT_LOCK:
        runs = dict(_IN_FLIGHT)
    for run_id in runs:
        _cancel_flow_run(run_id, _state_of(run_id))
    return list(runs.values())


def _state_of(flow_run_id):
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            return client.read_flow_run(flow_run_id).state
    except Exception:
        return None


def check_node_deployments(p: Params) -> None:
    """Before any round (executor deployment): a Prefect API the node machines can reach, and each node's
    deployment there with a live runner; one line naming what is missing."""
    import os

    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    if os.environ.get(TEMPORARY_API_ENV):
        raise NodeFailed("orchestration.executor is deployment, but PREFECT_API_URL is not set: node machines cannot "
                         "reach this process's temporary Prefect server; start one (prefect server start --host "
                         "0.0.0.0) and export PREFECT_API_URL=http://<this machine>:4200/api here and on every "
                         "node machine", retryable=False)
    nodes = range(sync_method(p.spes).nodes)
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


def stop_on_signals() -> None:
    """SIGTERM and SIGINT stop the orchestrator within seconds: node tasks give up, node flow runs are
    cancelled, node processes end, and the flow unwinds (releasing the run's lease on the way out)."""
    import signal

    def stop(signum, frame):
        cancelled = cancel_in_flight()
        logging.getLogger("spes.pipelines").warning("%s: stopping; cancelled %s", signal.Signals(signum).name,
                                                    ", ".join(cancelled) or "no node flow run")
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def _spare_allows(p: Params, run: str, r: int, node: int) -> Optional[str]:
    """Where a lost node may be retried instead of its own machine: the spare deployment, when its state is
    on shared storage (a checkpoint) or it has none yet; else None."""
    if not p.orchestration.spare_deployment:
        return None
    meta = Run(Store.from_config(p.storage), run).global_meta(r - 1)
    ref = meta.node_states.get(node)
    if ref is None or ref.checkpoint:
        return p.orchestration.spare_deployment
    return None


@task(task_run_name="node-{node}-round-{r}")
def node_task(p: Params, run: str, r: int, node: int, deadline: float, checkpoint: bool = False,
              tokens_key: Optional[str] = None) -> NodeReport:
    """One node's local steps. A crash raises (Prefect retries it); missing the round deadline returns
    status 'timeout' so the round proceeds with a quorum."""
    done = committed_report(Store.from_config(p.storage), run, r, node)
    if done is not None:  # committed by an earlier try or flow run
        return done
    remaining = deadline - time.time()
    if remaining <= 0:
        return NodeReport(node, "timeout")
    if p.orchestration.executor == "deployment":
        target = None
        # its machine was lost (this round, or it moved earlier): elsewhere, if its state allows
        if (run, r, node) in _LOST or (run, node) in _MOVED:
            target = _spare_allows(p, run, r, node)
            if target and (run, r, node) in _LOST:
                ref = Run(Store.from_config(p.storage), run).global_meta(r - 1).node_states.get(node)
                get_run_logger().warning("node %d round %d: its machine was lost; retrying it on %s (its state %s)",
                                         node, r, target, f"from the checkpoint of round {ref.round}" if ref else
                                         "new: its first round")
        try:
            status, report = _run_node_deployment(p, run, r, node, remaining, checkpoint, tokens_key, target)
        except NodeLost:
            _LOST.add((run, r, node))
            _MOVED.discard((run, node))  # a lost spare: its own machine first again
            raise
        if target is not None:
            _MOVED.add((run, node))  # later rounds go to the spare directly while its state allows
    else:
        status, report = _run_node_process(p, run, r, node, remaining, checkpoint)
    if status != "ok":
        get_run_logger().warning("node %d missed the round %d deadline", node, r)
        return NodeReport(node, status)
    return report


def worth_retrying(task, task_run, state) -> bool:
    """Prefect's retry condition: retry what another try can change (a dead node process, storage that did not
    answer), never an error that says something definite (a non-finite loss, a refused state, rejected
    uploads: the round driver re-runs those nodes itself)."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return exc is None or retryable(exc)


@task(task_run_name="aggregate-round-{r}")
def aggregate_task(p: Params, run: str, r: int, rerun_rejected: bool) -> GlobalMeta:
    return _aggregator(p, run).aggregate(r, p.orchestration.min_nodes, rerun_rejected)


_AGGREGATORS: dict[tuple[str, str], Aggregator] = {}


def _aggregator(p: Params, run: str) -> Aggregator:
    """One aggregator per run in this process: it holds the global it committed last for the next round."""
    key = (p.storage.url, run)
    if key not in _AGGREGATORS:
        _AGGREGATORS.clear()  # one run at a time per flow process: let the previous run's model go
        _AGGREGATORS[key] = Aggregator(p, Store.from_config(p.storage), run)
    return _AGGREGATORS[key]


def _table(rows: list[NodeReport]) -> list[dict]:
    """The round's table in the UI, for people; the raw numbers are in the round's record on storage."""
    return [{"node": n.node, "status": n.status + (f": {n.error}" if n.error else ""),
             "loss": fmt_loss(n.upload.loss_mean if n.upload else None), "tokens": f"{n.tokens:,}",
             "up": fmt_bytes(n.bytes_up), "down": fmt_bytes(n.bytes_down),
             "time": fmt_seconds(n.upload.seconds_load + n.upload.seconds_compute if n.upload else None),
             "expert load max/mean per layer": fmt_balance(n.upload.expert_load if n.upload else [])}
            for n in rows]


def _node_runner(p: Params, run: str, r: int, deadline: float, tokens_key):
    def run_nodes(nodes, checkpoint: bool) -> dict[int, NodeReport]:
        node = node_task.with_options(retries=p.orchestration.node_retries, retry_delay_seconds=1,
                                      retry_condition_fn=worth_retrying)
        futures = {i: node.submit(p, run, r, i, deadline, checkpoint, tokens_key) for i in nodes}
        wait(list(futures.values()))
        rows = {}
        for i, f in futures.items():
            try:
                rows[i] = f.result()
            except Exception as e:  # retries exhausted: the node is out of this round, its cause kept
                get_run_logger().error("node %d failed round %d: %s", i, r, e)
                rows[i] = NodeReport(i, "failed", error=f"{type(e).__name__}: {e}")
        return rows

    return run_nodes


@task(task_run_name="round-{r}")
def round_task(p: Params, run: str, r: int, checkpoint: bool = False, tokens_key: Optional[str] = None) -> RoundRecord:
    deadline = time.time() + p.orchestration.round_timeout_s
    aggregate = aggregate_task.with_options(retries=p.storage.retries, retry_delay_seconds=2,
                                            retry_condition_fn=worth_retrying)
    record = run_round(p, Run(Store.from_config(p.storage), run), r, _node_runner(p, run, r, deadline, tokens_key),
                       lambda rerun: aggregate(p, run, r, rerun), checkpoint, HeldOutProbe(p))
    agg, heldout = record.aggregate, record.heldout_loss
    create_table_artifact(_table(record.nodes), key=artifact_key(run, "round", r),
                          description=f"Round {r}: contributors {agg.contributors}, missing {agg.missing}, "
                                      f"merge alpha {agg.merge_alpha:.4g}, held-out loss {fmt_loss(heldout)}, "
                                      f"wall {fmt_seconds(record.wall_s)} (+ {fmt_seconds(record.heldout_s)} "
                                      "held-out evaluation)")
    return record
