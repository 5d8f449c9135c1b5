"""A node's round on one rank or on several (`orchestration.gpus_per_node`).

One rank: `spes.round.node.NodeRound` in this process. Several: a torchrun job per round,

    python -m torch.distributed.run --standalone --nproc-per-node G -m pipelines.node_ranks REQUEST THREADS EVENTS

whose ranks train data parallel (DDP over the node's GPUs with NCCL, or CPU processes with gloo where
`orchestration.device` is cpu); rank 0 alone reads and writes shared storage. The job speaks the one node
wire format (pipelines/node_events.py): REQUEST holds the NodeRequest's line, and rank 0 writes the round's
result event to EVENTS, read back as every carrier's stream is. Every round reloads the node's state from
its folder, so a job per round costs only the start of G interpreters, small next to `sync.every_steps` steps at
the scale several GPUs are for.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from spes.round.context import RoundContext
    from spes.run.records import NodeReport

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_AHEAD: list = []
"""This process's round trained ahead (sync.overlap; spes/round/lookahead.py), made on first use."""


def lookahead():
    from spes.round.lookahead import Lookahead

    if not _AHEAD:
        _AHEAD.append(Lookahead())
    return _AHEAD[0]


def check_ranks(p) -> None:
    """gpus_per_node GPUs must be visible where the node computes on CUDA; a one-line error before compute."""
    import torch

    from spes.errors import DeviceError
    from spes.train.devices import resolve_device

    g = p.orchestration.gpus_per_node
    if resolve_device(p.orchestration.device).type == "cuda" and g > torch.cuda.device_count():
        raise DeviceError(f"orchestration.gpus_per_node is {g}, but this machine has {torch.cuda.device_count()} "
                          "visible CUDA device(s)")


def run_node(ctx: RoundContext, r: int, node: int, tokens_dir: str, threads: int,
             on_step: Optional[Callable[[int], None]] = None, checkpoint: bool = False,
             from_checkpoint: bool = False) -> NodeReport:
    """The node's round; its report (what NodeRound.run returns)."""
    from spes.data.tokens import TokenData
    from spes.round.node import NodeRound

    p, run = ctx.p, ctx.name
    if p.orchestration.gpus_per_node == 1:
        return NodeRound(ctx, r, node, TokenData.open(tokens_dir), on_step=on_step, checkpoint=checkpoint,
                          from_checkpoint=from_checkpoint).run(lookahead())
    check_ranks(p)
    from pipelines.node_events import read_stream
    from pipelines.request import NodeRequest
    from spes.config.loader import to_dict
    from spes.errors import NodeFailed

    g = p.orchestration.gpus_per_node
    with tempfile.TemporaryDirectory(prefix=f"spes-node{node}-r{r}-") as tmp:
        request, events = os.path.join(tmp, "request.json"), os.path.join(tmp, "events.jsonl")
        with open(request, "w") as f:
            f.write(NodeRequest(to_dict(p), run, r, node, checkpoint, tokens_dir=tokens_dir,
                                from_checkpoint=from_checkpoint).line() + "\n")
        env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        rc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={g}",
                             "-m", "pipelines.node_ranks", request, str(max(1, threads // g)), events],
                            env=env).returncode
        if not os.path.exists(events):  # rank 0 wrote no result, not even its error: the job itself failed
            raise NodeFailed(f"node {node} round {r}: its torchrun job of {g} ranks failed (exit {rc}); "
                             "the ranks' output is above")
        with open(events) as f:  # the round's result (its report, or rank 0's error): its log went to stdout
            return read_stream(f, lambda event: None, node, r, f"the torchrun job's {events}")


def rank_main(request_path: str, threads: int, events_path: str) -> None:
    """One rank of a node's torchrun job."""
    import torch
    import torch.distributed as dist

    from pipelines.node_events import EventFormatter, result_event
    from pipelines.request import NodeRequest
    from spes.config.loader import params_from_dict
    from spes.data.tokens import TokenData
    from spes.round.context import RoundContext
    from spes.round.node import NodeRound
    from spes.train.devices import resolve_device

    with open(request_path) as f:
        req = NodeRequest.from_line(f.read())
    p = params_from_dict(req.params)
    node, local_rank = req.node, int(os.environ["LOCAL_RANK"])
    device = resolve_device(p.orchestration.device, node * p.orchestration.gpus_per_node + local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(threads)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    lead = dist.get_rank() == 0
    if lead:  # rank 0's log and progress, as events, on the stdout the job shares with its node worker
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(EventFormatter())
        logging.getLogger("spes").addHandler(handler)
        logging.getLogger("spes").setLevel(logging.INFO)
    out = None
    try:
        out = result_event(NodeRound(RoundContext.build(p, req.run, role="node machine"), req.round, node,
                                      TokenData.open(req.tokens_dir), checkpoint=req.checkpoint,
                                      from_checkpoint=req.from_checkpoint).run())
    except Exception as e:  # rank 0 reports the node's own error (and whether a retry may help), then fails
        out = result_event(error=e)
        raise
    finally:
        if lead and out is not None:  # whole or absent: a killed job leaves no half result
            with open(events_path + ".part", "w") as f:
                f.write(out.line() + "\n")
            os.replace(events_path + ".part", events_path)
        dist.destroy_process_group()


if __name__ == "__main__":
    rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
