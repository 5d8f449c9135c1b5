"""Prefect flow for SPES training: a run is a sequence of sync rounds on shared storage.

  spes-training (flow)            one writer per run (lease on storage), resumes from a committed round
    round-<r> (task)              fans out one node task per node, then aggregates
      node-<i>-round-<r> (task)   a node process (or a deployment on a GPU machine); retried on crash
      aggregate-round-<r> (task)  quorum of committed nodes -> committed global model

Per round, a table artifact (node, loss, tokens, bytes up/down, seconds, expert load) and a progress
artifact for the run show up in the Prefect UI.
"""

# No `from __future__ import annotations` here: Prefect's runner pickles a served flow by value, and
# its parameter annotations must resolve as objects in the child process.
import hashlib
import json
import os
import re
import tempfile
import time
from typing import Any, Optional, Union

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.futures import wait

from pipelines.lease import RunLease
from pipelines.node_pool import POOL, NodeFailed
from spes.config import Params, load_params, params_from_dict, to_dict
from spes.rounds import aggregate_round, commit_initial, committed_nodes
from spes.store import Store, StoreError
from spes.token_share import publish_tokens, tokens_rel


def artifact_key(*parts: Any) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(str(p) for p in parts).lower()).strip("-")


FINGERPRINT_SECTIONS = ("model", "init", "spes", "tokenize", "dense")


def _non_default(d: Any, default: Any) -> Any:
    if isinstance(d, dict) and isinstance(default, dict):
        out = {k: _non_default(v, default.get(k)) for k, v in d.items() if k not in default or v != default[k]}
        return {k: v for k, v in out.items() if v != {} or k not in default}
    return d


def fingerprint_of(settings: dict, init_sha: str) -> str:
    """Only settings that differ from the schema's defaults count, so a release that adds a setting (at a
    default that keeps the old behaviour) leaves existing runs resumable."""
    defaults = to_dict(Params())
    keep = {k: _non_default(settings.get(k, {}), defaults[k]) for k in FINGERPRINT_SECTIONS}
    keep["init_sha256"] = init_sha
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def run_fingerprint(p: Params, init_sha: str) -> str:
    """What makes committed rounds reusable: same model, init, data and SPES settings."""
    return fingerprint_of(to_dict(p), init_sha)


# -- node --------------------------------------------------------------------------------------------
def _run_node_process(params_json: str, run: str, r: int, node: int, timeout_s: float) -> str:
    """Run the round on the node's long-lived process, relaying its output to the Prefect log."""
    logger = get_run_logger()
    status, _ = POOL.get(node).run_round({"params": params_json, "run": run, "round": r, "node": node}, timeout_s,
                                         lambda line: logger.info("node %d | %s", node, line))
    return status


@task(task_run_name="node-{node}-round-{r}")
def node_task(params_json: str, run: str, r: int, node: int, deadline: float, executor: str,
              node_deployment: str, tokens_key: Optional[str] = None) -> dict:
    """One node's local steps. A crash raises (Prefect retries it); missing the round deadline returns
    status 'timeout' so the round proceeds with a quorum."""
    p = params_from_dict(json.load(open(params_json)))
    store = Store(p.storage.url, p.storage.options)
    if not store.is_committed(store.node_dir(run, r, node)):
        remaining = deadline - time.time()
        if remaining <= 0:
            return {"node": node, "status": "timeout"}
        if executor == "deployment":
            status = _run_node_deployment(node_deployment, p, run, r, node, remaining, tokens_key)
        else:
            status = _run_node_process(params_json, run, r, node, remaining)
        if status != "ok":
            get_run_logger().warning("node %d missed the round %d deadline", node, r)
            return {"node": node, "status": status}
    manifest = store.read_manifest(store.node_dir(run, r, node))
    return {**manifest["meta"], "status": "ok", "bytes_up": manifest["files"]["upload.safetensors"]["bytes"]}


def _run_node_deployment(name: str, p: Params, run: str, r: int, node: int, timeout_s: float,
                         tokens_key: Optional[str]) -> str:
    """Real clusters: the node runs as a flow on a worker of a GPU machine (see pipelines/node_flow.py),
    reading the token shards published to shared storage under `tokens_key`."""
    from prefect.deployments import run_deployment

    fr = run_deployment(name, parameters={"params": to_dict(p), "run": run, "r": r, "node": node,
                                          "tokens": tokens_key},
                        timeout=timeout_s, flow_run_name=f"{run}-node-{node}-round-{r}")
    if fr.state is None or not fr.state.is_final():
        _cancel_flow_run(fr.id)  # a straggler must not keep its GPU busy into the next round
        return "timeout"
    if not fr.state.is_completed():
        raise NodeFailed(f"node {node} round {r}: deployment run ended {fr.state.name}")
    return "ok"


def _cancel_flow_run(flow_run_id) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
    except Exception as e:  # the round goes on without the node either way
        get_run_logger().warning("could not cancel node flow run %s: %s", flow_run_id, e)


@task(task_run_name="aggregate-round-{r}")
def aggregate_task(params_json: str, run: str, r: int, min_nodes: Optional[int]) -> dict:
    p = params_from_dict(json.load(open(params_json)))
    return aggregate_round(p, Store(p.storage.url, p.storage.options), run, r, min_nodes)


@task(task_run_name="round-{r}")
def round_task(params_json: str, run: str, r: int, tokens_key: Optional[str] = None) -> dict:
    p = params_from_dict(json.load(open(params_json)))
    o = p.orchestration
    t0 = time.time()
    deadline = t0 + o.round_timeout_s
    node = node_task.with_options(retries=o.node_retries, retry_delay_seconds=1)
    futures = [node.submit(params_json, run, r, i, deadline, o.executor, o.node_deployment, tokens_key)
               for i in range(p.spes.num_nodes)]
    wait(futures)
    rows = []
    for i, f in enumerate(futures):
        try:
            rows.append(f.result())
        except Exception as e:  # retries exhausted: the node is out of this round
            get_run_logger().error("node %d failed round %d: %s", i, r, e)
            rows.append({"node": i, "status": f"failed: {type(e).__name__}"})
    agg = aggregate_task(params_json, run, r, o.min_nodes)
    wall = time.time() - t0
    compute = max((row.get("seconds_compute", 0.0) for row in rows), default=0.0)
    table = [{"node": row["node"], "status": row["status"], "loss": round(row.get("loss_mean", float("nan")), 4),
              "tokens": row.get("tokens", 0), "bytes_up": row.get("bytes_up", 0),
              "bytes_down": row.get("bytes_down", 0),
              "seconds": round(row.get("seconds_load", 0) + row.get("seconds_compute", 0), 2),
              "expert_load": json.dumps([sum(x) for x in zip(*row.get("expert_load", []))]) if row.get("expert_load") else ""}
             for row in rows]
    create_table_artifact(table, key=artifact_key(run, "round", r),
                          description=f"Round {r}: contributors {agg['contributors']}, missing {agg['missing']}, "
                                      f"merge alpha {agg['merge_alpha']:.4g}, wall {wall:.1f}s")
    record = {"round": r, "wall_s": wall, "max_node_compute_s": compute, "nodes": rows, "aggregate": agg}
    store = Store(p.storage.url, p.storage.options)
    if not store.is_committed(record_dir(store, run, r)):
        store.write_bundle(record_dir(store, run, r), {}, record)
    return record


def record_dir(store: Store, run: str, r: int) -> str:
    """How round r went (wall time, per-node rows): kept beside the round, so a stage re-run that finds its
    rounds already committed reports them rather than nothing."""
    return f"{store.round_dir(run, r)}/record"


def round_records(store: Store, run: str, first: int, last: int) -> list[dict]:
    return [store.read_manifest(record_dir(store, run, r))["meta"] for r in range(first, last + 1)
            if store.is_committed(record_dir(store, run, r))]


# -- run ----------------------------------------------------------------------------------------------
def _resolve_start(store: Store, run: str, resume_round: Union[int, str, None], logger) -> int:
    latest = store.latest_round(run)
    if latest is None:
        raise StoreError(f"run {run!r} has no committed round on {store.url}")
    if resume_round in (None, "latest"):
        return latest + 1
    k = int(resume_round)
    if k not in store.committed_rounds(run):
        raise StoreError(f"run {run!r}: round {k} is not committed (committed: {store.committed_rounds(run)})")
    moved = store.supersede_after(run, k)
    if moved:
        logger.warning("resuming from round %d: rounds %s moved to runs/%s/superseded/", k, moved, run)
    return k + 1


def _ensure_run(store: Store, p: Params, run: str, init_path: Optional[str], on_mismatch: str, logger) -> None:
    """Round 0 from the init model; refuse (or restart) when storage holds a run made with other settings."""
    from safetensors.torch import load_file

    info_path = store.path(f"runs/{run}/run.json")
    init_sha = hashlib.sha256(open(init_path, "rb").read()).hexdigest() if init_path else "external"
    fp = run_fingerprint(p, init_sha)
    if store.fs.exists(info_path):
        held = json.loads(store.fs.cat_file(info_path))
        if held["fingerprint"] == fp or init_path is None:
            return
        if on_mismatch != "restart":
            raise StoreError(f"run {run!r} on {store.url} was made with other settings (fingerprint "
                             f"{held['fingerprint']} != {fp}); use another orchestration.run_name or restart it")
        moved = store.supersede_after(run, -1)
        logger.warning("settings changed: rounds %s of run %s moved to superseded/", moved, run)
    if init_path is None:
        if store.is_committed(store.global_dir(run, 0)):
            return  # a run started elsewhere (round 0 committed directly)
        raise StoreError(f"run {run!r} does not exist on {store.url} and no init model was given")
    if not store.is_committed(store.global_dir(run, 0)):
        from spes.config import ModelConfig
        from spes.model import CausalLM

        cfg = json.load(open(os.path.join(os.path.dirname(init_path), "config.json")))
        model = CausalLM(ModelConfig(**cfg["model_config"]))
        model.load_canonical_state_dict(load_file(init_path))
        commit_initial(store, run, model, source=cfg.get("source", "init"))
    store.fs.pipe_file(info_path, json.dumps({"fingerprint": fp, "created_at": time.time()}).encode())


def _flow_run_name() -> str:
    """'<run>-<stage>[-resume-<K>]', so resumed runs stand out in the UI."""
    from prefect.runtime import flow_run

    prm = flow_run.parameters
    run = prm.get("run_name")
    if not run:
        try:
            run = load_params(prm["params_path"], list(prm.get("overrides") or [])).orchestration.run_name
        except Exception:  # a bad params file fails the flow itself, with the config error
            run = "spes"
    resume = prm.get("resume_round")
    return f"{run}-{prm.get('stage', 'all')}" + (f"-resume-{resume}" if resume is not None else "")


@flow(name="spes-training", flow_run_name=_flow_run_name, log_prints=True)
def spes_training(params_path: str = "params.yaml", overrides: Optional[list[str]] = None, stage: str = "all",
                  resume_round: Optional[Union[int, str]] = None, run_name: Optional[str] = None,
                  init_path: Optional[str] = None, on_mismatch: str = "error") -> dict:
    """Run rounds up to the stage's last round ('warmup' -> spes.warmup_rounds, 'train'/'all' -> spes.rounds),
    continuing after the latest committed round, or after round `resume_round` (later ones are set aside)."""
    logger = get_run_logger()
    p = load_params(params_path, list(overrides or []) + ([f"orchestration.run_name={run_name}"] if run_name else []))
    run = p.orchestration.run_name
    store = Store(p.storage.url, p.storage.options)
    with RunLease(store, run, p.orchestration.lock_ttl_s) as lease:
        try:
            return _run_rounds(p, store, run, lease, stage, resume_round, init_path, on_mismatch, logger)
        finally:
            POOL.close()


def _run_rounds(p: Params, store: Store, run: str, lease: RunLease, stage: str, resume_round, init_path,
                on_mismatch: str, logger) -> dict:
    """The flow's body, run while it holds the run's writer lease."""
    if stage not in ("warmup", "train", "all"):
        raise ValueError(f"stage must be warmup|train|all, got {stage!r}")
    if p.orchestration.executor == "process":
        POOL.start(range(p.spes.num_nodes))  # no-op for processes started before the flow (stages.rounds)
    _ensure_run(store, p, run, init_path, on_mismatch, logger)
    first = _resolve_start(store, run, resume_round, logger)
    tokens_key = None
    if p.orchestration.executor == "deployment":  # nodes elsewhere read the tokens from shared storage
        secrets = sorted(set(p.storage.options) & {"key", "secret", "token", "password"})
        if secrets:
            logger.warning("storage.options %s go to every node as flow run parameters (stored by the Prefect "
                           "server); prefer AWS_* environment variables on the node machines", secrets)
        tokens_key = publish_tokens(store, os.path.join(p.artifacts_dir, "tokens"))
        logger.info("token shards on shared storage: %s", tokens_rel(tokens_key))
    last = p.spes.warmup_rounds if stage == "warmup" else p.spes.rounds
    workdir = tempfile.mkdtemp(prefix=f"spes-{run}-")
    params_json = os.path.join(workdir, "params.json")
    with open(params_json, "w") as f:
        json.dump(to_dict(p), f)
    progress = create_progress_artifact(progress=0.0, key=artifact_key(run, "progress"),
                                        description=f"rounds committed of {p.spes.rounds}")
    rounds = []
    for r in range(first, last + 1):
        res = round_task.with_options(task_run_name=f"round-{r}")(params_json, run, r, tokens_key)
        rounds.append(res)
        logger.info("round %d committed: contributors %s, wall %.1fs", r, res["aggregate"]["contributors"],
                    res["wall_s"])
        update_progress_artifact(progress, 100.0 * r / p.spes.rounds)
        lease.check()
    return {"run": run, "first_round": first, "last_round": max(last, first - 1), "rounds": rounds,
            "latest_committed": store.latest_round(run),
            "committed_nodes_last": committed_nodes(store, run, store.latest_round(run) or 0, p.spes.num_nodes)}

