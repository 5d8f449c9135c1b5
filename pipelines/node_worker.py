"""A node's long-lived process: `python -m pipelines.node_worker` reads one NodeRequest per line on stdin
(pipelines/request.py), runs that node's round (spes.round.node: its state from its local folder, the global
from storage; a torchrun job of orchestration.gpus_per_node ranks where that is > 1, see node_ranks.py)
and writes the round's events on stdout (pipelines/node_events.py: its log and progress, then its result).
Staying alive across rounds saves the interpreter and torch start (seconds per round on small machines);
since every round reloads its state (its local folder, and storage), a killed worker is simply replaced and
the result is the same.
Faults for tests: `SPES_FAULT_PLAN` (pipelines/faults.py).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Optional

NODES_HERE_ENV = "SPES_NODES_HERE"
"""Set by a node host (pipelines/node_host.py) for its worker processes: the nodes sharing this machine's cores."""


def tokens_folder(p, store, req) -> str:
    """Where this node reads token shards: the sender's folder, the shards published on shared storage under
    `req.tokens` (fetched once into orchestration.node_cache_dir, sha256-verified), or the local artifacts."""
    if req.tokens_dir:
        return req.tokens_dir
    if req.tokens:
        from spes.run.token_share import fetch_tokens

        return fetch_tokens(store, req.tokens, p.orchestration.node_cache_dir).folder
    return os.path.join(p.artifacts_dir, "tokens")


_CONTEXT: dict = {}
"""The last request's params and run, and the round context built from them: a node process parses its
params and opens storage once per run, not once per round."""


def round_context(req):
    from spes.config.loader import params_from_dict
    from spes.round.context import RoundContext

    if _CONTEXT.get("key") != (req.params, req.run):
        _CONTEXT.clear()
        _CONTEXT.update(key=(req.params, req.run), ctx=RoundContext.build(params_from_dict(req.params), req.run,
                                                                        role="node machine"))
    return _CONTEXT["ctx"]


def run_request(req, nodes_here: Optional[int], faults):
    """The node's round for `req` in this process, on this machine's cores shared among `nodes_here` nodes
    (None: all of the run's nodes, as the process executor runs them)."""
    import torch

    from pipelines.node_ranks import run_node
    from spes.train.devices import node_threads

    ctx = round_context(req)
    p, store = ctx.p, ctx.store
    threads = node_threads(p, nodes_here or ctx.method.nodes)
    torch.set_num_threads(threads)
    r, node, run = req.round, req.node, req.run
    meta = run_node(ctx, r, node, tokens_folder(p, store, req), threads, on_step=faults.hook(run, r, node),
                    checkpoint=req.checkpoint, from_checkpoint=req.from_checkpoint)
    faults.after_commit(run, r, node, store.path(ctx.layout.node_dir(r, node)))
    if r == p.sync.rounds:  # the run's last round: its local state goes once the run's last global is committed
        threading.Thread(target=_forget_when_finished, args=(p, store, run, node), daemon=True).start()
    return meta


def _forget_when_finished(p, store, run: str, node: int) -> None:
    """Wait (up to the round timeout) for the run's last global, then keep of this machine's copy of the
    node's state only what a resume from a round still on storage needs (the last round checkpoints every
    node's state on shared storage, where an extension of the run reads it)."""
    import time

    from spes.run.local_runs import forget_finished_run

    deadline = time.time() + p.orchestration.round_timeout_s
    while time.time() < deadline:
        try:
            gone = forget_finished_run(p, store, run, node)
        except Exception as e:  # storage unreachable: keep the state, say why
            logging.getLogger("spes").warning("node %d: could not check whether run %s finished: %s", node, run, e)
            return
        if gone:
            logging.getLogger("spes").info("node %d: run %s finished; kept of its local state only what a "
                                           "resume needs: %s", node, run, gone)
            return
        time.sleep(2.0)


def serve() -> int:
    import torch._dynamo  # noqa: F401  the first optimizer construction imports it (~3 s): pay that before round 1

    from pipelines.faults import FaultPlan
    from pipelines.node_events import EventFormatter, result_event
    from pipelines.request import NodeRequest

    # the library's log and progress go to stdout as events, which the pool relays to the node task's log
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(EventFormatter())
    logging.getLogger("spes").addHandler(handler)
    logging.getLogger("spes").setLevel(logging.INFO)
    faults = FaultPlan.from_env()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = NodeRequest.from_line(line)
            nodes_here = int(os.environ[NODES_HERE_ENV]) if os.environ.get(NODES_HERE_ENV) else None
            out = result_event(run_request(req, nodes_here, faults))
        except Exception as e:  # report, stay alive for the next command
            out = result_event(error=e)
        print(out.line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
