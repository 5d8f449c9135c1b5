"""Where node rounds run: one interface (`NodeExecutor`), one implementation per `orchestration.executor`,
chosen by the registry; no other module compares an executor's name.

    process     long-lived node processes on this machine (pipelines/node_pool.py); a node of several ranks
                (orchestration.gpus_per_node > 1) runs each round as a torchrun job (pipelines/node_ranks.py)
    deployment  each node a `spes-node` Prefect deployment served by the machine that holds it
                (pipelines/deployment_nodes.py), watched by heartbeat on shared storage

Adding an executor (a Ray or Slurm one) is one new subclass (here or in its own module) and its entry in
EXECUTORS, plus the name in spes/config/choices.py's EXECUTORS (tests/pipelines/test_executors.py keeps the
two equal).
"""

# No `from __future__ import annotations` here: Prefect's runner pickles a served flow by value, and
# its parameter annotations must resolve as objects in the child process. Prefect itself is imported inside
# the methods only: stages.rounds picks its executor before PREFECT_API_URL is set, and Prefect reads its
# settings at import (imported earlier, it would start a temporary server of its own).
import os
from abc import ABC, abstractmethod
from typing import Callable, Optional

from pipelines import stopping
from pipelines.node_events import NodeEvent
from pipelines.node_pool import POOL
from pipelines.request import NodeRequest
from pipelines.round_progress import RoundProgress
from spes.config.loader import to_dict
from spes.config.schema import Params
from spes.data.tokens import TokenData, check_vocab
from spes.errors import IntegrityError, OrchestrationError, RecordError
from spes.round.context import RoundContext
from spes.round.driver import round_members
from spes.run.layout import tokens_dir
from spes.run.local_runs import open_node_state
from spes.run.records import NodeReport, StateRef
from spes.run.token_share import publish_tokens


class NodeExecutor(ABC):
    """The life of a run's nodes as the orchestrator sees it: checked before anything starts, started, asked
    for one round at a time (with a deadline), closed."""

    name: str
    nodes_here: bool = False
    """Whether the nodes run on this machine (their cache and state folders are then checked here)."""

    def preflight(self, p: Params) -> None:
        """At the stage's start, before the Prefect server or any node: what is wrong with the settings."""

    def prepare(self, ctx: RoundContext) -> None:
        """Before the run's lease and its first round: the nodes can be reached."""

    def start(self, ctx: RoundContext) -> None:
        """Start what the nodes need ahead of their first round (overlapping the flow's own setup)."""

    def share_tokens(self, ctx: RoundContext) -> Optional[str]:
        """Make the token shards reachable by the nodes; the key nodes fetch them by, or None (read here)."""
        return None

    def local_state_checker(self, ctx: RoundContext) -> Optional[Callable[[int, StateRef], bool]]:
        """Whether node i's state `ref` is held where it runs, when the orchestrator can see that (None: it
        cannot; a resume then trusts only the states checkpointed on shared storage)."""
        return None

    @abstractmethod
    def run_node(self, ctx: RoundContext, r: int, node: int, timeout_s: float, checkpoint: bool,
                 tokens_key: Optional[str]) -> tuple[str, Optional[NodeReport]]:
        """Node `node`'s round r of the run: ('ok', its report), or ('timeout', None) when it missed the
        deadline."""

    def close(self) -> None:
        """Stop what start() started."""


class ProcessExecutor(NodeExecutor):
    name = "process"
    nodes_here = True

    def start(self, ctx: RoundContext) -> None:
        POOL.start(range(ctx.method.nodes))  # no-op for processes already started (stages.rounds)

    def share_tokens(self, ctx: RoundContext) -> Optional[str]:
        tokens = os.path.join(ctx.p.artifacts_dir, "tokens")
        if os.path.exists(tokens):  # nodes here read these: refuse ids the model cannot embed before round 1
            check_vocab(ctx.p.model.vocab_size, TokenData.open(tokens), tokens)
        return None

    def local_state_checker(self, ctx: RoundContext) -> Optional[Callable[[int, StateRef], bool]]:
        run = ctx.run
        run_id = run.info()["run_id"]
        return lambda node, ref: open_node_state(ctx.p, run.store, run.name, run_id, node).has_state(ref)

    def run_node(self, ctx, r, node, timeout_s, checkpoint, tokens_key):
        """The round on the node's long-lived process, its output relayed to the Prefect log."""
        from prefect import get_run_logger

        logger = get_run_logger()
        req = NodeRequest(to_dict(ctx.p), ctx.name, r, node, checkpoint)
        progress = RoundProgress.of(ctx.name, r)

        def relay(event: NodeEvent) -> None:
            logger.info("node %d | %s", node, event.sentence())
            if progress is not None and event.progress is not None:
                progress.node_done(node, event.progress.fraction, event.progress)

        status, report = POOL.get(node).run_round(req, timeout_s, relay, cancelled=stopping.STOPPING.is_set)
        if status == "cancelled":
            raise stopping.Stopped(f"node {node} round {r}: the orchestrator is stopping")
        return status, report

    def close(self) -> None:
        POOL.close()


class DeploymentExecutor(NodeExecutor):
    name = "deployment"

    def preflight(self, p: Params) -> None:
        if not os.environ.get("PREFECT_API_URL"):
            raise OrchestrationError("orchestration.executor is deployment, but PREFECT_API_URL is not set: node machines "
                              "need a Prefect server they can reach (prefect server start --host 0.0.0.0; export "
                              "PREFECT_API_URL=http://<this machine>:4200/api here and on every node machine)")
        from pipelines.prefect_api import check_api_access

        check_api_access(os.environ["PREFECT_API_URL"])

    def prepare(self, ctx: RoundContext) -> None:
        """The API and the runner of each member of the next round (all nodes before round 0, or while the
        latest round is damaged: the flow sets it aside, then checks again)."""
        from pipelines.deployment_nodes import check_node_deployments

        try:
            latest = ctx.run.latest_round()
            members = round_members(ctx, latest + 1) if latest is not None else None
        except (IntegrityError, RecordError):
            members = None
        check_node_deployments(ctx.p, range(ctx.method.nodes) if members is None else members)

    def share_tokens(self, ctx: RoundContext) -> Optional[str]:
        """Deployment nodes on other machines read the token shards from shared storage."""
        from prefect import get_run_logger

        logger = get_run_logger()
        p, store = ctx.p, ctx.store
        secrets = sorted(set(p.storage.options) & {"key", "secret", "token", "password"})
        if secrets:
            logger.warning("storage.options %s go to every node as flow run parameters (stored by the Prefect "
                           "server); prefer AWS_* environment variables on the node machines", secrets)
        key = publish_tokens(store, os.path.join(p.artifacts_dir, "tokens"))
        logger.info("token shards on shared storage: %s", tokens_dir(key))
        return key

    def run_node(self, ctx, r, node, timeout_s, checkpoint, tokens_key):
        from pipelines.deployment_nodes import run_on_deployment

        return run_on_deployment(ctx, r, node, timeout_s, checkpoint, tokens_key)


EXECUTORS: dict[str, type[NodeExecutor]] = {"process": ProcessExecutor, "deployment": DeploymentExecutor}


def executor_for(p: Params) -> NodeExecutor:
    """The executor `orchestration.executor` names (a Params is validated: the name is in the registry)."""
    return EXECUTORS[p.orchestration.executor]()
