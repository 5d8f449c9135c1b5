"""The node as a Prefect flow, for real clusters: serve it on every GPU machine,

    python -m pipelines.node_flow            # on each GPU machine (a worker per machine)

and set `orchestration.executor: deployment`; each node task then calls run_deployment on it.
The node reads the global model from shared storage and commits its bundle there, as in process mode.
"""

import os

from prefect import flow

from spes.config import params_from_dict
from spes.data import TokenData
from spes.rounds import node_round
from spes.store import Store


@flow(name="spes-node", flow_run_name="{run}-node-{node}-round-{r}")
def spes_node(params: dict, run: str, r: int, node: int) -> dict:
    p = params_from_dict(params)
    import torch

    torch.set_num_threads(max(1, p.orchestration.threads_per_node))
    data = TokenData.open(os.path.join(p.artifacts_dir, "tokens"))
    return node_round(p, Store(p.storage.url, p.storage.options), run, r, node, data)


if __name__ == "__main__":
    spes_node.serve(name="spes-node")
