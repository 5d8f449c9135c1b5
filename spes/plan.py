"""`python -m spes.plan`: the planner's command line. What a node holds in memory (spes/train/plan.py; see its
doc for the flags) and, with --link, a round's transfer against its compute (spes/train/link_plan.py)."""
from __future__ import annotations

import argparse
import json

from spes.cli import run_command
from spes.train.capacity import capacity_plan
from spes.train.link_plan import DEFAULT_MFU, DEFAULT_TFLOPS, link_plan, link_report, parse_duration, parse_rate
from spes.train.plan import __doc__ as PLAN_DOC
from spes.train.plan import gib, parse_bytes, report, summary


def main() -> None:
    from spes.config.loader import load_params

    ap = argparse.ArgumentParser(description=PLAN_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--gpu-mem", default=None, help="memory of one device, e.g. 48GiB")
    ap.add_argument("--json", action="store_true", help="end with one JSON line: fits, peak_bytes_per_gpu, ...")
    ap.add_argument("--nodes", default=None,
                    help="memory of each node's GPU, e.g. 24GiB,48GiB,80GiB: plan how many experts each owns")
    ap.add_argument("--link", default=None, help="each node's link rate, e.g. 100Mbit/s: price a round's transfer")
    ap.add_argument("--rtt", default="0ms", help="each node's round-trip time to storage, e.g. 50ms")
    ap.add_argument("--storage-link", default=None, help="the storage side's rate, shared by all nodes")
    ap.add_argument("--tflops", type=float, default=DEFAULT_TFLOPS, help="peak TFLOPS of one GPU (default %(default)s)")
    ap.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="model FLOPs utilization (default %(default)s)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args()  # overrides anywhere on the line
    p = load_params(a.params, a.overrides)  # a ConfigError ends the command in one line (spes.cli)
    gpu_mem = parse_bytes(a.gpu_mem, "--gpu-mem") if a.gpu_mem is not None else None
    link = None if a.link is None else link_plan(
        p, p.orchestration.gpus_per_node, parse_rate(a.link, "--link"),
        parse_duration(a.rtt, "--rtt"), parse_rate(a.storage_link, "--storage-link") if a.storage_link else None,
        a.tflops, a.mfu)
    if a.nodes:
        cp = capacity_plan(p, [parse_bytes(x, "--nodes") for x in a.nodes.split(",")],
                           p.orchestration.gpus_per_node)
    if a.nodes:
        for i, (c, cap, peak, mem) in enumerate(zip(cp["experts_per_node"], cp["max_experts_per_node"],
                                                    cp["peak_bytes"], cp["memory_bytes"])):
            print(f"node {i}: {gib(mem)}, owns {c} of {p.model.num_experts} experts per layer (fits up to {cap}); "
                  f"peak per GPU {gib(peak)}")
        print("settings: " + " ".join(cp["overrides"]))
        if a.json:
            print(json.dumps(cp))
        return
    print("\n".join(report(p, p.orchestration.gpus_per_node, gpu_mem)))
    if link is not None:
        print("\n".join(link_report(link)))
    if a.json:
        out = summary(p, p.orchestration.gpus_per_node, gpu_mem)
        print(json.dumps(out if link is None else {**out, "link": link}))


if __name__ == "__main__":
    run_command(main)
