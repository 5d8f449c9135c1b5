"""One sync round as Prefect tasks: a node task per node (fanned out), then the aggregate task.

    round-<r> (task)              fans out one node task per node, then aggregates; held-out loss of the new
                                  global; writes the round record; applies the storage retention
      node-<i>-round-<r> (task)   a node process here, or a `spes-node` deployment on a GPU machine; retried
      aggregate-round-<r> (task)  quorum of verified uploads -> committed delta + global model; an upload
                                  that fails verification is set aside and its node re-run once

Tasks receive the parsed, validated `Params` from the flow (nothing is re-read from disk). A table
artifact per round (node, loss, tokens, bytes up/down, seconds, expert load) shows in the Prefect UI.
"""

# No `from __future__ import annotations` here: Prefect's runner pickles a served flow by value, and
# its parameter annotations must resolve as objects in the child process.
import json
import os
import re
import time
from typing import Any, Optional

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.futures import wait

from pipelines.node_pool import POOL
from spes.config.loader import to_dict
from spes.config.schema import Params
from spes.data.tokens import TokenData
from spes.errors import NodeFailed, UploadsRejected
from spes.eval.heldout import heldout_loss
from spes.round.aggregator import aggregate_round
from spes.round.node import node_meta
from spes.run.layout import RunLayout
from spes.run.run import Run
from spes.storage.store import Store


def artifact_key(*parts: Any) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(str(p) for p in parts).lower()).strip("-")


# -- node executors ----------------------------------------------------------------------------------
def _run_node_process(p: Params, run: str, r: int, node: int, timeout_s: float,
                      checkpoint: bool) -> tuple[str, Optional[dict]]:
    """Run the round on the node's long-lived process, relaying its output to the Prefect log."""
    logger = get_run_logger()
    cmd = {"params": to_dict(p), "run": run, "round": r, "node": node, "checkpoint": checkpoint}
    return POOL.get(node).run_round(cmd, timeout_s, lambda line: logger.info("node %d | %s", node, line))


def _run_node_deployment(p: Params, run: str, r: int, node: int, timeout_s: float, checkpoint: bool,
                         tokens_key: Optional[str]) -> tuple[str, Optional[dict]]:
    """Real clusters: the node runs as a flow on a worker of a GPU machine (see pipelines/node_flow.py),
    reading the token shards published to shared storage under `tokens_key`. Its result reaches us through
    storage (the node's committed bundle), the one channel both sides share."""
    from prefect.deployments import run_deployment

    fr = run_deployment(p.orchestration.node_deployment,
                        parameters={"params": to_dict(p), "run": run, "r": r, "node": node, "tokens": tokens_key,
                                    "checkpoint": checkpoint},
                        timeout=timeout_s, flow_run_name=f"{run}-node-{node}-round-{r}")
    if fr.state is None or not fr.state.is_final():
        _cancel_flow_run(fr.id)  # a straggler must not keep its GPU busy into the next round
        return "timeout", None
    if not fr.state.is_completed():
        raise NodeFailed(f"node {node} round {r}: deployment run ended {fr.state.name}")
    store = Store.from_config(p.storage)
    return "ok", node_meta(store.read_manifest(RunLayout(run).node_dir(r, node)))


def _cancel_flow_run(flow_run_id) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
    except Exception as e:  # the round goes on without the node either way
        get_run_logger().warning("could not cancel node flow run %s: %s", flow_run_id, e)


@task(task_run_name="node-{node}-round-{r}")
def node_task(p: Params, run: str, r: int, node: int, deadline: float, checkpoint: bool = False,
              tokens_key: Optional[str] = None) -> dict:
    """One node's local steps. A crash raises (Prefect retries it); missing the round deadline returns
    status 'timeout' so the round proceeds with a quorum."""
    store = Store.from_config(p.storage)
    rel = RunLayout(run).node_dir(r, node)
    if store.is_committed(rel):  # committed by an earlier try or flow run
        return {**node_meta(store.read_manifest(rel)), "status": "ok"}
    remaining = deadline - time.time()
    if remaining <= 0:
        return {"node": node, "status": "timeout"}
    if p.orchestration.executor == "deployment":
        status, meta = _run_node_deployment(p, run, r, node, remaining, checkpoint, tokens_key)
    else:
        status, meta = _run_node_process(p, run, r, node, remaining, checkpoint)
    if status != "ok":
        get_run_logger().warning("node %d missed the round %d deadline", node, r)
        return {"node": node, "status": status}
    return {**meta, "status": "ok"}


@task(task_run_name="aggregate-round-{r}")
def aggregate_task(p: Params, run: str, r: int, rerun_rejected: bool) -> dict:
    return aggregate_round(p, Store.from_config(p.storage), run, r, p.orchestration.min_nodes, rerun_rejected)


def _table(rows: list[dict]) -> list[dict]:
    def load(row):
        return json.dumps([sum(x) for x in zip(*row["expert_load"])]) if row.get("expert_load") else ""

    return [{"node": row["node"], "status": row["status"], "loss": round(row.get("loss_mean", float("nan")), 4),
             "tokens": row.get("tokens", 0), "bytes_up": row.get("bytes_up", 0), "bytes_down": row.get("bytes_down", 0),
             "seconds": round(row.get("seconds_load", 0) + row.get("seconds_compute", 0), 2), "expert_load": load(row)}
            for row in rows]


def _run_nodes(p: Params, run: str, r: int, nodes, deadline: float, checkpoint: bool, tokens_key) -> dict[int, dict]:
    node = node_task.with_options(retries=p.orchestration.node_retries, retry_delay_seconds=1)
    futures = {i: node.submit(p, run, r, i, deadline, checkpoint, tokens_key) for i in nodes}
    wait(list(futures.values()))
    rows = {}
    for i, f in futures.items():
        try:
            rows[i] = f.result()
        except Exception as e:  # retries exhausted: the node is out of this round
            get_run_logger().error("node %d failed round %d: %s", i, r, e)
            rows[i] = {"node": i, "status": f"failed: {type(e).__name__}"}
    return rows


def round_heldout(p: Params, run: str, r: int) -> Optional[float]:
    """Held-out loss of the committed global r on the first eval.round_batches batches (None when not due)."""
    e = p.eval
    if not e.every_rounds or r % e.every_rounds:
        return None
    model, _ = Run(Store.from_config(p.storage), run).load_model(r)
    data = TokenData.open(os.path.join(p.artifacts_dir, "tokens"))
    return heldout_loss(model, data.val, e.batch_size, e.seq_len, e.round_batches)["loss"]


@task(task_run_name="round-{r}")
def round_task(p: Params, run: str, r: int, checkpoint: bool = False, tokens_key: Optional[str] = None) -> dict:
    logger = get_run_logger()
    t0 = time.time()
    deadline = t0 + p.orchestration.round_timeout_s
    rows = _run_nodes(p, run, r, range(p.spes.nodes), deadline, checkpoint, tokens_key)
    try:
        agg = aggregate_task(p, run, r, rerun_rejected=True)
    except UploadsRejected as e:  # a committed upload failed verification: that node's failure; run it again
        logger.error("round %d: %s; re-running nodes %s", r, e, sorted(e.nodes))
        rows.update(_run_nodes(p, run, r, sorted(e.nodes), deadline, checkpoint, tokens_key))
        agg = aggregate_task(p, run, r, rerun_rejected=False)
    wall = time.time() - t0
    rows = [rows[i] for i in sorted(rows)]
    heldout = round_heldout(p, run, r)
    compute = max((row.get("seconds_compute", 0.0) for row in rows), default=0.0)
    create_table_artifact(_table(rows), key=artifact_key(run, "round", r),
                          description=f"Round {r}: contributors {agg['contributors']}, missing {agg['missing']}, "
                                      f"merge alpha {agg['merge_alpha']:.4g}, held-out loss "
                                      f"{'-' if heldout is None else f'{heldout:.4f}'}, wall {wall:.1f}s")
    record = {"round": r, "wall_s": wall, "max_node_compute_s": compute, "nodes": rows, "aggregate": agg,
              "heldout_loss": heldout, "tokens": sum(row.get("tokens", 0) for row in rows)}
    run_state = Run(Store.from_config(p.storage), run)
    run_state.write_record(r, record)
    dropped = run_state.prune(p.storage.keep_rounds, p.checkpoint.keep_last)
    if dropped:
        logger.info("retention: models of rounds %s deleted (records kept)", dropped)
    return record
