"""The node as a Prefect flow, for real clusters: serve it on every GPU machine,

    python -m pipelines.node_flow            # on each GPU machine (a worker per machine)

and set `orchestration.executor: deployment`; each node task then calls run_deployment on it.
The node reads the global model from shared storage and commits its bundle there, as in process mode.
Token shards come from shared storage too (`tokens`: the key the training flow published them under),
cached in `orchestration.node_cache_dir` on the node's machine; without a key, the local artifacts are used.
"""

# No `from __future__ import annotations` here: Prefect's runner pickles a served flow by value, and
# its parameter annotations must resolve as objects in the child process.
import os
from typing import Optional

from prefect import flow

from pipelines.faults import FaultPlan
from pipelines.node_ranks import run_node
from spes.config.loader import params_from_dict
from spes.run.token_share import fetch_tokens
from spes.storage.store import Store
from spes.train.devices import node_threads


@flow(name="spes-node", flow_run_name="{run}-node-{node}-round-{r}")
def spes_node(params: dict, run: str, r: int, node: int, tokens: Optional[str] = None, checkpoint: bool = False) -> dict:
    p = params_from_dict(params)
    import torch

    threads = node_threads(p, 1)  # a deployment node has its machine to itself
    torch.set_num_threads(threads)
    store = Store.from_config(p.storage)
    folder = os.path.join(p.artifacts_dir, "tokens")
    if tokens:
        folder = fetch_tokens(store, tokens, p.orchestration.node_cache_dir).folder
    return run_node(p, store, run, r, node, folder, threads, on_step=FaultPlan.from_env().hook(run, r, node),
                    checkpoint=checkpoint).to_json()


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="spes-node", help="the deployment's name (orchestration.node_deployment "
                                                         "is '<flow>/<name>': spes-node/spes-node)")
    a = ap.parse_args()
    if not os.environ.get("PREFECT_API_URL"):  # else it would serve against a temporary server nobody sees
        raise SystemExit("node_flow: PREFECT_API_URL is not set; point it at the orchestrator's Prefect server, "
                         "e.g. export PREFECT_API_URL=http://<orchestrator>:4200/api")
    spes_node.serve(name=a.name)


if __name__ == "__main__":
    main()
