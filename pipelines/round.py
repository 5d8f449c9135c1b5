"""One sync round as Prefect tasks, around the library's round driver (spes/round/driver.py):

    round-<r> (task)              run_round: fans out one node task per node, then aggregates; held-out loss
                                  of the new global; the round record; storage retention
      node-<i>-round-<r> (task)   a node process here, or a `spes-node` deployment on a GPU machine
                                  (pipelines/deployment_nodes.py); retried
      aggregate-round-<r> (task)  quorum of verified uploads -> committed delta + global model (retried: an
                                  uncommitted attempt is redone whole); an upload that fails verification is
                                  set aside and its node re-run once

Tasks receive the parsed, validated `Params` from the flow (nothing is re-read from disk) and work with their
flow run's session (pipelines/flow_runs.py): the run's context (spes/round/context.py), the aggregator and the
executor, built once where the flow run starts: one store, one sync method and codec, and one read of global
r-1 per round in this process. A table
artifact per round (node, loss, tokens, bytes up/down, seconds, expert load) shows in the Prefect UI.
"""

# No `from __future__ import annotations` here: Prefect's runner pickles a served flow by value, and
# its parameter annotations must resolve as objects in the child process.
import os
import re
import time
from typing import Any, Optional

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.futures import wait

from pipelines.flow_runs import FLOW_RUNS
from pipelines.formatting import fmt_balance, fmt_bytes, fmt_experts, fmt_loss, fmt_metrics, fmt_seconds
from pipelines.round_progress import RoundProgress
from spes.config.schema import Params
from spes.errors import retryable
from spes.round.driver import HeldOutProbe, round_members, run_round
from spes.round.node import committed_report
from spes.run.records import GlobalMeta, NodeReport, RoundRecord


def experiment_label() -> str:
    """The DVC experiment this process runs in (`DVC_EXP_NAME`, set by `dvc exp run`), or ''. Flow-run names
    and artifact keys carry it, so `default-train` of two experiments are told apart in the Prefect UI."""
    return os.environ.get("DVC_EXP_NAME", "")


def artifact_key(*parts: Any) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes; a DVC experiment's name comes first."""
    exp = experiment_label()
    parts = ((exp,) if exp else ()) + parts
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(str(p) for p in parts).lower()).strip("-")


@task(task_run_name="node-{node}-round-{r}")
def node_task(p: Params, run: str, r: int, node: int, deadline: float, checkpoint: bool = False,
              tokens_key: Optional[str] = None) -> NodeReport:
    """One node's local steps. A crash raises (Prefect retries it); missing the round deadline returns
    status 'timeout' so the round proceeds with a quorum."""
    session = FLOW_RUNS.current(p, run)
    ctx = session.ctx
    done = committed_report(ctx.run, r, node)
    if done is not None:  # committed by an earlier try or flow run
        return done
    remaining = deadline - time.time()
    if remaining <= 0:
        return NodeReport(node, "timeout")
    status, report = session.node_executor.run_node(ctx, r, node, remaining, checkpoint, tokens_key)
    if status != "ok":
        get_run_logger().warning("node %d missed the round %d deadline", node, r)
        return NodeReport(node, status)
    progress = RoundProgress.of(run, r)
    if progress is not None:
        progress.node_done(node, 1.0, force=True)
    return report


def worth_retrying(task, task_run, state) -> bool:
    """Prefect's retry condition: retry what another try can change (a dead node process, storage that did not
    answer), never an error that says something definite (a non-finite loss, a refused state, rejected
    uploads: the round driver re-runs those nodes itself)."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return exc is None or retryable(exc)


@task(task_run_name="aggregate-round-{r}")
def aggregate_task(p: Params, run: str, r: int, rerun_rejected: bool) -> GlobalMeta:
    return FLOW_RUNS.current(p, run).aggregator.aggregate(r, p.orchestration.min_nodes, rerun_rejected)


def _table(rows: list[NodeReport], agg: GlobalMeta) -> list[dict]:
    """The round's table in the UI, for people; the raw numbers are in the round's record on storage. `experts`:
    what the node trained this round, and what it trains next round where that changes."""
    after = agg.membership.owners if agg.membership is not None else {}

    def experts(n: NodeReport) -> str:
        now = fmt_experts(n.upload.experts) if n.upload else "-"
        if n.upload and n.node in after and sorted(after[n.node]) != sorted(n.upload.experts):
            return f"{now}, then {fmt_experts(after[n.node])}"
        return now if n.node in after or not agg.membership else f"{now}, then none (no longer a member)"

    return [{"node": n.node, "experts trained": experts(n), "status": n.status + (f": {n.error}" if n.error else ""),
             "train loss (round mean)": fmt_loss(n.upload.loss_mean if n.upload else None),
             "tokens": f"{n.tokens:,}", "up": fmt_bytes(n.bytes_up), "down": fmt_bytes(n.bytes_down),
             "load + compute": fmt_seconds(n.upload.seconds_load + n.upload.seconds_compute if n.upload else None),
             "expert load max/mean": fmt_balance(n.upload.expert_load if n.upload else [])}
            for n in rows] + [{"node": j, "experts trained": f"joins: {fmt_experts(e)} from the next round"}
                              for j, e in sorted(after.items()) if j not in {n.node for n in rows}]


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
    ctx = FLOW_RUNS.current(p, run).ctx
    RoundProgress.start(artifact_key(run, "round", r, "progress"), run, r, len(round_members(ctx, r)))
    aggregate = aggregate_task.with_options(retries=p.storage.retries, retry_delay_seconds=2,
                                            retry_condition_fn=worth_retrying)
    record = run_round(ctx, r, _node_runner(p, run, r, deadline, tokens_key),
                       lambda rerun: aggregate(p, run, r, rerun), checkpoint, HeldOutProbe(p))
    for line in record.aggregate.membership_changes:
        get_run_logger().warning("round %d: %s", r, line)
    create_table_artifact(_table(record.nodes, record.aggregate), key=artifact_key(run, "round", r),
                          description=table_description(record))
    return record


def table_description(record: RoundRecord) -> str:
    """The round table's line in the UI: who contributed, the merge, the held-out loss and every other metric
    of the round's record by name, and the times."""
    agg = record.aggregate
    changes = f"; membership: {'; '.join(agg.membership_changes)}" if agg.membership_changes else ""
    return (f"Round {record.round}: contributors {agg.contributors}, missing {agg.missing}{changes}, merge alpha "
            f"{agg.merge_alpha:.4g}, held-out loss {fmt_loss(record.heldout_loss)}{fmt_metrics(record.metrics)}, "
            f"wall {fmt_seconds(record.wall_s)} (+ {fmt_seconds(record.heldout_s)} held-out evaluation)")
