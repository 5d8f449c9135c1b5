"""The nodes of one GPU machine as Prefect deployments, for real clusters. On each machine:

    export PREFECT_API_URL=http://<orchestrator>:4200/api
    python -m pipelines.node_flow --nodes 0,1           # deployments spes-node/spes-node-0, spes-node/spes-node-1

and set `orchestration.executor: deployment`: node i's round runs as a flow run of `spes-node/spes-node-<i>`
(orchestration.node_deployment), which only the machine that holds node i serves, so a node always runs
where its state is. The machine keeps one warm process per node across rounds (pipelines/node_host.py) and
runs its flow runs on threads of this process (pipelines/node_runner.py: no fresh interpreter per round);
each flow run hands its request to the node's process, writes the node's heartbeat on shared storage while
it works (spes/run/heartbeat.py) and relays the node's log lines to the Prefect UI. At most `--limit` rounds train at
once on this machine (default: one per visible GPU, or one per node on a CPU-only machine); others wait.

`--spare` also serves `spes-node/spes-node-spare` (orchestration.spare_deployment): any node whose state
allows it (on shared storage, or none yet) may be retried there when its own machine is lost.

The node reads the global model from shared storage and commits its upload there. Token shards come from
shared storage too (the key the training flow published them under), cached in
`orchestration.node_cache_dir` on this machine.
"""

# No `from __future__ import annotations` here: Prefect's runner pickles a served flow by value, and
# its parameter annotations must resolve as objects in the child process.
import os
import socket
import threading
from typing import Optional

from prefect import flow, get_run_logger

from pipelines.library_logs import relay_library_logs
from pipelines.node_events import NodeEvent
from pipelines.node_host import HOST_ENV, host_round
from pipelines.request import NodeRequest
from spes.cli import run_command
from spes.config.loader import params_from_dict
from spes.errors import MissingInput, UsageError
from spes.run.heartbeat import Heartbeat
from spes.storage.files import FileStore

SPARE = "spare"
_CONNECTIONS: dict = {}
"""flow run id -> its connection to the node host (closing it kills the node's round)"""


@flow(name="spes-node", flow_run_name="{run}-node-{node}-round-{r}")
def spes_node(params: dict, run: str, r: int, node: int, tokens: Optional[str] = None, checkpoint: bool = False,
              from_checkpoint: bool = False) -> dict:
    relay_library_logs()
    p = params_from_dict(params)
    store = FileStore.from_config(p.storage, role="node machine")
    req = NodeRequest(params, run, r, node, checkpoint, tokens, from_checkpoint=from_checkpoint)
    logger = get_run_logger()
    with Heartbeat(store, run, r, node, p.orchestration.heartbeat_timeout_s / 4) as beat:
        host = os.environ.get(HOST_ENV)
        if host:  # the machine's warm node process
            from prefect.runtime import flow_run

            def relay(event: NodeEvent) -> None:  # to the Prefect log; its progress rides on the heartbeat
                logger.info("node %d | %s", node, event.sentence())
                if event.progress is not None:
                    beat.progress, beat.event = event.progress.fraction, event.progress.fields()

            key = str(flow_run.id)
            try:
                report = host_round(host, req, relay, on_connect=lambda conn: _CONNECTIONS.__setitem__(key, conn))
            finally:
                _CONNECTIONS.pop(key, None)
        else:  # served without a host (a flow run started by hand): the round in this process
            report = _in_process(req)
    return report.to_json()


def cancel_flow_run(flow_run_id) -> None:
    """Stop a flow run's round: its connection to the node host closes, the host kills the round."""
    conn = _CONNECTIONS.get(str(flow_run_id))
    if conn is not None:
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _in_process(req: NodeRequest):
    from pipelines.faults import FaultPlan
    from pipelines.node_worker import run_request

    return run_request(req, 1, FaultPlan.from_env())  # a deployment node has its machine to itself


def parse_nodes(text: str) -> list[int]:
    """'0,1' or '0-3' or '0,2-3' -> node ids."""
    out: list[int] = []
    for part in filter(None, (t.strip() for t in text.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise UsageError(f"--nodes {text!r}: expected node ids like 0,1 or 0-3")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(out))


def default_limit(nodes: int) -> int:
    """Rounds at once on this machine: one per visible GPU; on a CPU-only machine one per node it serves."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    return max(1, nodes)


def main() -> None:
    import argparse
    import signal

    from pipelines.node_host import NodeHost
    from pipelines.node_runner import NodeRunner

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="", help="the nodes this machine holds, e.g. 0,1 or 0-3")
    ap.add_argument("--spare", action="store_true", help="also take any node whose state allows it (spare deployment)")
    ap.add_argument("--name", default="spes-node-{node}",
                    help="deployment name per node; orchestration.node_deployment is 'spes-node/<this>'")
    ap.add_argument("--limit", type=int, default=None, help="rounds at once on this machine (default: one per GPU)")
    ap.add_argument("--poll-s", type=float, default=0.25, help="seconds between the runner's queries for new runs")
    a = ap.parse_args()
    if not os.environ.get("PREFECT_API_URL"):  # else it would serve against a temporary server nobody sees
        raise MissingInput("PREFECT_API_URL is not set; point it at the orchestrator's Prefect server, "
                           "e.g. export PREFECT_API_URL=http://<orchestrator>:4200/api")
    from pipelines.prefect_api import check_api_access

    check_api_access(os.environ["PREFECT_API_URL"])  # a protected server without the auth string: one line
    nodes = parse_nodes(a.nodes)
    if not nodes and not a.spare:
        raise UsageError("name the nodes this machine holds (--nodes 0,1) and/or --spare")
    names = [a.name.replace("{node}", str(i)) for i in nodes] + ([a.name.replace("{node}", SPARE)] if a.spare else [])
    host = NodeHost(None if a.spare else nodes, a.limit or default_limit(len(names)))
    os.environ[HOST_ENV] = host.path  # the flow runs of this process find the host through it
    host.start_workers()
    # no deployment concurrency limit: Prefect reschedules a run refused a slot ~30 s later; the host runs
    # one round per node at a time instead (a second request for a node waits for the first). Flow runs
    # are light (the host trains): room for a finishing run beside each node's next one.
    runner = NodeRunner(spes_node, [spes_node.to_deployment(name=n) for n in names], a.poll_s,
                        2 * len(names) + 1, cancel_flow_run)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        runner.register()
        print(f"node_flow: serving {', '.join('spes-node/' + n for n in names)} (Ctrl-C to stop)", flush=True)
        runner.serve_forever(stop)
    except KeyboardInterrupt:
        pass
    finally:
        host.close()  # kills the node processes: a round in flight fails, the orchestrator retries it


if __name__ == "__main__":
    run_command(main)
