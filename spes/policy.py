"""`python -m spes.policy`: the S3 (IAM) policy of a node machine's key or of the orchestrator's key.

    python -m spes.policy node --nodes 0,1 [--params params.yaml] [--run NAME] [--url s3://BUCKET/PREFIX]
    python -m spes.policy orchestrator [--params params.yaml] [--run NAME] [--url ...]

Prints the policy JSON for the run's storage (storage.url of the params, or --url): attach it to the key
(an IAM user's or role's) that machine uses. A node machine's key may write only its own nodes' uploads,
states, heartbeats and join/leave requests; the orchestrator's owns the run. What each role reads and why
both may list names: spes/run/access.py; docs/many-machines.md (Security) has the commands end to end.
"""
from __future__ import annotations

import argparse
import json

from spes.cli import run_command
from spes.config.loader import load_params
from spes.errors import UsageError
from spes.run.access import iam_policy, node_grants, orchestrator_grants, split_s3_url
from spes.run.layout import RunLayout


def parse_nodes(text: str) -> list[int]:
    try:
        nodes = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--nodes takes node ids separated by commas (e.g. 0,1), got {text!r}") from None
    if not nodes or min(nodes) < 0:
        raise UsageError(f"--nodes takes node ids >= 0 separated by commas (e.g. 0,1), got {text!r}")
    return nodes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", choices=("node", "orchestrator"))
    ap.add_argument("--nodes", default=None, help="node: the node ids this machine trains, e.g. 0,1")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--run", default=None, help="run name (default: orchestration.run_name)")
    ap.add_argument("--url", default=None, help="the storage URL (default: storage.url of the params)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    p = load_params(a.params, a.overrides)
    bucket, prefix = split_s3_url(a.url or p.storage.url)
    layout = RunLayout(a.run or p.orchestration.run_name)
    if a.role == "node":
        if a.nodes is None:
            raise UsageError("node needs --nodes (the node ids this machine trains, e.g. 0,1)")
        grants = node_grants(layout, parse_nodes(a.nodes))
    else:
        if a.nodes is not None:
            raise UsageError("orchestrator takes no --nodes (its key owns the whole run)")
        grants = orchestrator_grants(layout)
    print(json.dumps(iam_policy(grants, bucket, prefix), indent=2))


if __name__ == "__main__":
    run_command(main)
