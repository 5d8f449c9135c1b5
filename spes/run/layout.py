"""Where a run's state lives on shared storage: every path of the layout, in one place.

    runs/<run>/info/                          run identity: fingerprint of the settings, run id (a bundle)
    runs/<run>/lease/<gen:010d>.json          writer lease generations (exclusive create; highest holds)
    runs/<run>/rounds/<r:06d>/global/         the committed model (+ DiLoCo outer state, server residual);
                                              meta: contributors, and the node states it was built with
    runs/<run>/rounds/<r:06d>/delta/          what nodes download: the encoded delta from global r-1 (sync.py)
    runs/<run>/rounds/<r:06d>/nodes/<i:03d>/  node i's upload: its encoded delta against global r-1
    runs/<run>/rounds/<r:06d>/states/<i:03d>/ node i's state after round r, at checkpoint rounds only
                                              (otherwise it stays on the node: spes/run/node_state.py)
    runs/<run>/rounds/<r:06d>/record/         how the round went: wall time, per-node rows, held-out loss
    runs/<run>/superseded/<stamp>/<r:06d>/    rounds set aside by a resume from an earlier round (or a restart)
    runs/<run>/rejected/<r>-<i>-<stamp>/      node uploads that failed verification, kept for inspection
    runs/<run>/heartbeats/<i:03d>.json        node i's heartbeat while it works on another machine
    runs/<run>/membership/<kind>-<i:05d>.json a join or leave request for node i (spes/run/membership.py)
    data/tokens/<key>/                        token shards for nodes on other machines (raw files)

Every folder but `lease/`, `superseded/`, `heartbeats/` and `membership/` is a bundle (`spes/storage/store.py`):
visible once committed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from spes.config.schema import check_name
from spes.sync.deltas import MODEL_FILE, OUTER_FILE, RESIDUAL_FILE  # noqa: F401  - a global bundle's files

ANY_ROUND = "*"
"""In place of a round number: the pattern of that path in every round (access policies, spes/run/access.py)."""
TOKENS_ROOT = "data/tokens"

Round = Union[int, str]


@dataclass(frozen=True)
class RunLayout:
    run: str

    REQUEST_KINDS = ("join", "leave")

    def __post_init__(self):
        check_name(self.run, "run name")

    @property
    def base(self) -> str:
        return f"runs/{self.run}"

    @property
    def info(self) -> str:
        return f"{self.base}/info"

    @property
    def lease_dir(self) -> str:
        return f"{self.base}/lease"

    def lease_file(self, gen: int) -> str:
        return f"{self.lease_dir}/{gen:010d}.json"

    @property
    def rounds_dir(self) -> str:
        return f"{self.base}/rounds"

    def round_dir(self, r: Round) -> str:
        return f"{self.rounds_dir}/{ANY_ROUND if r == ANY_ROUND else f'{r:06d}'}"

    def global_dir(self, r: Round) -> str:
        return f"{self.round_dir(r)}/global"

    def node_dir(self, r: Round, node: int) -> str:
        return f"{self.round_dir(r)}/nodes/{node:03d}"

    def delta_dir(self, r: Round) -> str:
        return f"{self.round_dir(r)}/delta"

    def state_dir(self, r: Round, node: int) -> str:
        return f"{self.round_dir(r)}/states/{node:03d}"

    def record_dir(self, r: int) -> str:
        return f"{self.round_dir(r)}/record"

    @property
    def membership_dir(self) -> str:
        """Join and leave requests (spes/run/membership.py)."""
        return f"{self.base}/membership"

    def request_file(self, kind: str, node: int) -> str:
        return f"{self.membership_dir}/{kind}-{node:05d}.json"

    def heartbeat(self, node: int) -> str:
        """The node's heartbeat while it works on a round on another machine (spes/run/heartbeat.py)."""
        return f"{self.base}/heartbeats/{node:03d}.json"

    def rejected_dir(self, r: int, node: int, stamp: str) -> str:
        return f"{self.base}/rejected/{r:06d}-{node:03d}-{stamp}"

    def superseded_dir(self, stamp: str) -> str:
        return f"{self.base}/superseded/{stamp}"


def tokens_dir(key: str) -> str:
    check_name(key, "token data key")
    return f"{TOKENS_ROOT}/{key}"
