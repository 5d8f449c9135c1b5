"""`python -m spes.members`: ask for a node to join or leave a running run, or show who trains what.

    python -m spes.members join  --node 3 [--gpu-mem 24GiB] [--params params.yaml] [--run NAME]
    python -m spes.members leave --node 1
    python -m spes.members show

A request takes effect at the next round boundary: the aggregator of the round in progress applies it and
records the new membership in that round's global; the node then starts (join) or stops (leave) with the
round after it. See spes/run/membership.py. With --gpu-mem the planner (spes/train/plan.py) caps the
joiner at the most experts per layer that fit that memory; a memory too small for the frozen weights alone
is refused. A request that cannot be (an id in use, a node that is not a
member, the last member leaving, one already pending) is refused with one line and nothing is written.
"""
from __future__ import annotations

import argparse

from spes.cli import run_command
from spes.config.loader import load_params
from spes.errors import MembershipError, SpesError, UsageError
from spes.round.context import RoundContext
from spes.run.membership import latest_membership, request
from spes.train.capacity import max_experts_fitting
from spes.train.plan import parse_bytes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("join", "leave", "show"))
    ap.add_argument("--node", type=int, default=None)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--run", default=None, help="run name (default: orchestration.run_name)")
    ap.add_argument("--gpu-mem", default=None, help="join: memory of the node's GPU, e.g. 24GiB (caps its experts)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    try:
        p = load_params(a.params, a.overrides)
        run = a.run or p.orchestration.run_name
        ctx = RoundContext.build(p, run)
        store, method = ctx.store, ctx.method
        if a.action == "show":
            latest, m = latest_membership(store, run, method)
            print(f"run {run}: round {latest + 1}'s members")
            for n in m.members:
                limit = f", at most {m.caps[n]} experts" if n in m.caps else ""
                print(f"node {n}: experts {m.owners[n]}, data slot {m.slots[n]}, missed {m.missed.get(n, 0)} "
                      f"in a row{limit}")
            return
        if a.node is None:
            raise MembershipError(f"{a.action} needs --node")
        cap = None
        if a.gpu_mem is not None and a.action == "join":
            cap = max_experts_fitting(p, parse_bytes(a.gpu_mem, "--gpu-mem"), p.orchestration.gpus_per_node,
                                      f"node {a.node}")
        request(store, run, method, a.action, a.node, cap, p.orchestration.min_nodes)
    except ValueError as e:  # a builtin one from below (e.g. a malformed number): as a usage error
        if isinstance(e, SpesError):
            raise
        raise UsageError(str(e)) from None
    print(f"run {run}: node {a.node} will {a.action} at the next round boundary"
          + (f" (owning at most {cap} experts per layer)" if cap is not None else ""))


if __name__ == "__main__":
    run_command(main)
