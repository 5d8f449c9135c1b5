"""A node's round on one rank or on several (`orchestration.gpus_per_node`).

One rank: `spes.round.node.node_round` in this process. Several: a torchrun job per round,

    python -m torch.distributed.run --standalone --nproc-per-node G -m pipelines.node_ranks CMD.json OUT.json

whose ranks train data parallel (DDP over the node's GPUs with NCCL, or CPU processes with gloo where
`orchestration.device` is cpu); rank 0 alone reads and writes shared storage and writes the node's meta to
OUT.json. Every round reloads the node's state from its folder, so a job per round costs only the start
of G interpreters, small next to `sync_steps` steps at the scale several GPUs are for.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from spes.run.records import NodeReport

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_ranks(p) -> None:
    """gpus_per_node GPUs must be visible where the node computes on CUDA; a one-line error before compute."""
    import torch

    from spes.errors import DeviceError
    from spes.train.devices import resolve_device

    g = p.orchestration.gpus_per_node
    if resolve_device(p.orchestration.device).type == "cuda" and g > torch.cuda.device_count():
        raise DeviceError(f"orchestration.gpus_per_node is {g}, but this machine has {torch.cuda.device_count()} "
                          "visible CUDA device(s)")


def run_node(p, store, run: str, r: int, node: int, tokens_dir: str, threads: int,
             on_step: Optional[Callable[[int], None]] = None, checkpoint: bool = False,
             from_checkpoint: bool = False) -> NodeReport:
    """The node's round; its report (what node_round returns)."""
    from spes.data.tokens import TokenData
    from spes.round.node import node_round
    from spes.run.records import NodeReport

    if p.orchestration.gpus_per_node == 1:
        return node_round(p, store, run, r, node, TokenData.open(tokens_dir), on_step=on_step, checkpoint=checkpoint,
                          from_checkpoint=from_checkpoint)
    check_ranks(p)
    from pipelines.request import NodeRequest
    from spes.config.loader import to_dict
    from spes.errors import NodeFailed

    g = p.orchestration.gpus_per_node
    with tempfile.TemporaryDirectory(prefix=f"spes-node{node}-r{r}-") as tmp:
        cmd, out = os.path.join(tmp, "cmd.json"), os.path.join(tmp, "out.json")
        with open(cmd, "w") as f:
            json.dump({"request": NodeRequest(to_dict(p), run, r, node, checkpoint, tokens_dir=tokens_dir,
                                                   from_checkpoint=from_checkpoint).to_json(),
                       "threads": max(1, threads // g)}, f)
        env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        rc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={g}",
                             "-m", "pipelines.node_ranks", cmd, out], env=env).returncode
        if rc != 0 or not os.path.exists(out):
            raise NodeFailed(f"node {node} round {r}: its torchrun job of {g} ranks failed (exit {rc}); "
                                  "the ranks' output is above")
        with open(out) as f:
            return NodeReport.from_json(json.load(f), out)


def rank_main(cmd_path: str, out_path: str) -> None:
    """One rank of a node's torchrun job."""
    import torch
    import torch.distributed as dist

    from pipelines.request import NodeRequest
    from spes.config.loader import params_from_dict
    from spes.data.tokens import TokenData
    from spes.round.node import node_round
    from spes.storage.store import Store
    from spes.train.devices import resolve_device

    with open(cmd_path) as f:
        cmd = json.load(f)
    req = NodeRequest.from_json(cmd["request"])
    p = params_from_dict(req.params)
    node, local_rank = req.node, int(os.environ["LOCAL_RANK"])
    device = resolve_device(p.orchestration.device, node * p.orchestration.gpus_per_node + local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(int(cmd["threads"]))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        meta = node_round(p, Store.from_config(p.storage), req.run, req.round, node, TokenData.open(req.tokens_dir),
                          checkpoint=req.checkpoint, from_checkpoint=req.from_checkpoint)
        if dist.get_rank() == 0:
            with open(out_path + ".part", "w") as f:
                json.dump(meta.to_json(), f)
            os.replace(out_path + ".part", out_path)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2])
