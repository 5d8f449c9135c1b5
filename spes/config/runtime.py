"""The sections of where and how a run runs: checkpoints, shared storage, orchestration (nodes, quorum,
membership, leases)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from spes.config.choices import DEVICE_PATTERN, EXECUTORS, STORAGE_PROTOCOLS, check_name, need

DEPLOYMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass
class CheckpointConfig:
    every_rounds: int = 5
    """Nodes also write their state (optimizer, data position, residual) to shared storage every this many
    rounds and at the last round of a stage; in between it stays on the node (orchestration.node_state_dir).
    A run resumes from any machine at such rounds, from the nodes' own folders at the others."""
    keep_last: Optional[int] = None
    """With storage.keep_rounds set: keep only the last this many rounds resumable from shared storage
    (None = all of them; round 0 is always kept)."""

    def validate(self) -> None:
        need(self.every_rounds >= 1, f"checkpoint.every_rounds must be >= 1, got {self.every_rounds}")
        kl = self.keep_last
        need(kl is None or kl >= 1, f"checkpoint.keep_last must be >= 1 or null, got {kl}")


@dataclass
class StorageConfig:
    url: str = "artifacts/storage"
    """fsspec URL of shared storage: a local folder or s3://bucket/prefix."""
    options: dict[str, Any] = field(default_factory=dict)
    """fsspec storage options, e.g. {endpoint_url: http://127.0.0.1:5000}; credentials preferably from AWS_*."""
    timeout_s: float = 30.0
    """Connect and read timeout of one storage call (S3); a call that hangs longer is retried."""
    retries: int = 4
    """Retries of a failed storage call (exponential backoff from 0.5 s, each logged), then the call fails."""
    keep_rounds: Optional[int] = 2
    """Keep the last K rounds whole (their deltas refer to the round's node uploads); older rounds keep only
    their record, except round 0 and the rounds a resume can start from from shared storage, which keep
    their global and the node states they need. None = keep everything."""
    keep_superseded: Optional[int] = 2
    """Rounds set aside (a resume from an earlier round, a superseded run, a damaged round) go to
    runs/<run>/superseded/<stamp>/; keep the last this many stamps. None = keep them all."""

    def validate(self) -> None:
        need(bool(self.url), "storage.url must not be empty")
        proto, sep, rest = self.url.partition("://")
        if sep:  # else a local path
            need(proto in STORAGE_PROTOCOLS, f"storage.url {self.url!r}: protocol {proto!r} is not supported (a "
                                             "local path, file:// or s3://bucket/prefix)")
            need(proto != "s3" or bool(rest.split("/", 1)[0]), f"storage.url {self.url!r} names no bucket "
                                                               "(s3://bucket/prefix)")
        need(self.timeout_s > 0, f"storage.timeout_s must be > 0, got {self.timeout_s}")
        need(self.retries >= 0, f"storage.retries must be >= 0, got {self.retries}")
        ks, k = self.keep_superseded, self.keep_rounds
        need(ks is None or ks >= 1, f"storage.keep_superseded must be >= 1 or null, got {ks}")
        need(k is None or k >= 1, f"storage.keep_rounds must be >= 1 or null, got {k}")


@dataclass
class OrchestrationConfig:
    run_name: str = "default"
    """Names the run's folder on storage: letters, digits, '.', '_' and '-' only."""
    supersede: bool = False
    """When storage holds a run of this name made with other settings or another initial model: false =
    stop with an error saying so (choose another run_name, or set this); true = set its rounds aside to
    superseded/ and start it anew."""
    fresh: bool = False
    """Start this run anew even when storage holds it with the same settings (e.g. after a code change, which
    the fingerprint does not see): its rounds are set aside to superseded/."""
    executor: str = "process"
    """'process' = one subprocess per node on this machine; 'deployment' = run_deployment per node."""
    node_deployment: str = "spes-node/spes-node-{node}"
    """Deployment '<flow>/<name>' node i runs on ({node} is replaced by i): each machine serves the nodes it
    holds (`python -m pipelines.node_flow --nodes 0,1`), so a node always runs where its state is. Without
    {node}, every node runs on whichever machine takes it: only sound when its state comes from storage
    (checkpoint.every_rounds: 1)."""
    spare_deployment: Optional[str] = None
    """A deployment served by machines that can take any node (`node_flow --spare`): a node lost with its
    machine is retried there when its state allows (on shared storage, or none yet), the run saying so."""
    heartbeat_timeout_s: float = 60.0
    """Deployment nodes rewrite a heartbeat on shared storage every timeout/4; a node silent this long (its
    machine dead, or never picked up) is declared lost: its flow run is cancelled and it is retried
    (orchestration.node_retries) or left out under the quorum."""
    device: str = "auto"
    """Where nodes (and the dense stage) compute: auto | cpu | cuda | cuda:K (see spes/train/devices.py)."""
    node_cache_dir: str = "~/.cache/spes"
    """Deployment nodes keep the token shards fetched from shared storage here (on their own machine)."""
    node_state_dir: Optional[str] = None
    """Each node's own state between rounds, on its own machine (spes/run/node_state.py);
    None = <node_cache_dir>/state."""
    gpus_per_node: int = 1
    """Ranks of one node: >1 runs each node round as a torchrun job, data parallel (DDP) over the node's
    devices (GPUs, or CPU processes with gloo where device is cpu); rank 0 alone reads and writes storage."""
    threads_per_node: Optional[int] = None
    """Torch threads per node process; None = this machine's cores shared among the nodes it runs (process
    executor), all of them for a deployment node."""
    node_retries: int = 2
    round_timeout_s: float = 900.0
    """Nodes not committed by then are left out of the round (quorum permitting)."""
    min_nodes: Optional[int] = None
    """Quorum; None = all members."""
    membership_plan: list[str] = field(default_factory=list)
    """Planned membership changes, e.g. ['leave 1 after 4', 'join 2 after 70%']: each is asked for (as with
    `python -m spes.members`) when its round starts and applied when that round is aggregated; a joiner's first
    round is the next one. Spot machines with a known end, or the churn study of compare-churn."""
    evict_after_rounds: int = 0
    """A member that misses this many rounds in a row is evicted at the end of the last of them: its experts go
    to the other members (spes/run/membership.py), who train them from the next round on. 0 = never: its
    experts stay at their last committed value while it is away."""
    log_every_steps: int = 10
    """Each node logs its step, loss, tokens/s and the seconds left in the round every this many steps
    (relayed to its node task's log in the Prefect UI) and times them for its round record (TensorBoard's
    tokens/s within the round); a round trained ahead (sync.overlap) is timed without lines; 0 = never."""
    tensorboard_dir: Optional[str] = "tensorboard"
    """TensorBoard event files of every run, one folder per run (relative to artifacts_dir; spes/run/board.py):
    per-step train loss of each node and the learning rate, held-out loss, traffic, round times, merge alpha,
    expert balance, tokens on the x-axis. `tensorboard --logdir artifacts/tensorboard` (offline). null = off."""
    lock_ttl_s: float = 600.0
    """The run's writer lease on storage; refreshed every ttl/3 while a flow runs, free again after a crash."""

    def validate(self) -> None:
        """This section's own invariants; the quorum and the plan against sync.num_nodes are Params'."""
        o = self
        check_name(o.run_name, "orchestration.run_name")
        need(o.heartbeat_timeout_s > 0, f"orchestration.heartbeat_timeout_s must be > 0, got {o.heartbeat_timeout_s}")
        for key, value in (("node_deployment", o.node_deployment), ("spare_deployment", o.spare_deployment)):
            if value is None and key == "spare_deployment":
                continue
            ok = isinstance(value, str) and DEPLOYMENT_NAME.fullmatch(value.replace("{node}", "0")) is not None
            need(ok and str(value).count("{") == str(value).count("{node}"),
                 f"orchestration.{key} must be '<flow>/<deployment>' (optionally with {{node}}), got {value!r}")
        need(o.gpus_per_node >= 1, f"orchestration.gpus_per_node must be >= 1, got {o.gpus_per_node}")
        need(o.evict_after_rounds >= 0, f"orchestration.evict_after_rounds must be >= 0, got {o.evict_after_rounds}")
        need(bool(DEVICE_PATTERN.fullmatch(o.device)), f"orchestration.device must be auto|cpu|cuda|cuda:K, got {o.device!r}")
        need(o.executor in EXECUTORS, f"orchestration.executor must be {'|'.join(EXECUTORS)}, got {o.executor!r}")
        need(o.threads_per_node is None or o.threads_per_node >= 1,
             f"orchestration.threads_per_node must be >= 1 or null, got {o.threads_per_node}")
        need(o.log_every_steps >= 0, f"orchestration.log_every_steps must be >= 0, got {o.log_every_steps}")
        need(o.node_retries >= 0, f"orchestration.node_retries must be >= 0, got {o.node_retries}")
        need(o.round_timeout_s > 0, f"orchestration.round_timeout_s must be > 0, got {o.round_timeout_s}")
        need(o.lock_ttl_s >= 3, f"orchestration.lock_ttl_s must be >= 3 seconds (refreshed every ttl/3), got {o.lock_ttl_s}")
