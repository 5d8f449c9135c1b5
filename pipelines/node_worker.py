"""A node's long-lived process: `python -m pipelines.node_worker` reads one JSON command per line on stdin,
  {"params": "<params.json path>", "run": "...", "round": r, "node": i}
runs that node's round (spes.rounds.node_round: everything loaded from and committed to storage) and
answers one line `RESULT {...}` on stdout. Staying alive across rounds saves the interpreter and torch start
(seconds per round on small machines); since every round reloads its state from storage, a killed worker is
simply replaced and the result is the same.

`SPES_FAULT_PLAN` (JSON) injects faults for tests (here and in the `spes-node` deployment flow):
  {"kill": {"round": 2, "node": 1, "after_step": 3}}   SIGKILL once (a marker file makes it fire once)
  {"slow": {"round": 2, "node": 1, "seconds": 5}}        sleep before every step (a straggler)
each optionally limited to one run with "run": "<name>".
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

RESULT = "RESULT "


def fault_hook(plan: dict, run: str, r: int, node: int, marker_dir: str):
    def applies(f):
        return f and f["round"] == r and f["node"] == node and f.get("run", run) == run

    kill = plan.get("kill") if applies(plan.get("kill")) else None
    slow = plan.get("slow") if applies(plan.get("slow")) else None

    def on_step(i: int) -> None:
        if kill and i == kill.get("after_step", 0):
            marker = os.path.join(marker_dir, f"killed-r{r}-n{node}")
            if not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        if slow:
            time.sleep(float(slow["seconds"]))

    return on_step


def serve() -> int:
    import torch
    import torch._dynamo  # noqa: F401  the first optimizer construction imports it (~3 s): pay that before round 1

    from spes.config import params_from_dict
    from spes.data import TokenData
    from spes.rounds import node_round
    from spes.store import Store

    plan = json.loads(os.environ.get("SPES_FAULT_PLAN", "{}"))
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        with open(cmd["params"]) as f:
            p = params_from_dict(json.load(f))
        torch.set_num_threads(max(1, p.orchestration.threads_per_node))
        r, node = int(cmd["round"]), int(cmd["node"])
        hook = fault_hook(plan, cmd["run"], r, node, os.path.dirname(os.path.abspath(cmd["params"]))) if plan else None
        try:
            meta = node_round(p, Store(p.storage.url, p.storage.options), cmd["run"], r, node,
                              TokenData.open(os.path.join(p.artifacts_dir, "tokens")), on_step=hook)
            out = {"ok": True, "meta": {k: meta[k] for k in ("node", "round", "loss_mean", "tokens", "seconds_compute")}}
        except Exception as e:  # report, stay alive for the next command
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(RESULT + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
