"""What a node is asked to do for a round: one request type shared by every node executor (a process of
this machine, a torchrun job of several ranks, a `spes-node` deployment on another machine)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Optional

from spes.errors import ProtocolError


@dataclass(frozen=True)
class NodeRequest:
    params: dict
    """The run's resolved params (spes.config.loader.to_dict): nodes validate them again, read nothing else."""
    run: str
    round: int
    node: int
    checkpoint: bool = False
    """Also write the node's state to shared storage after this round."""
    tokens: Optional[str] = None
    """Key of the token shards on shared storage (deployments), or None: the local artifacts."""
    tokens_dir: Optional[str] = None
    """The node's local folder of token shards, where the sender already has one (torchrun ranks)."""
    from_checkpoint: bool = False
    """The node's state is on a machine that was lost: continue from its latest checkpoint on shared storage."""

    def to_json(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        """The request on the wire: one JSON line (a pipe, a socket or a torchrun job's request file)."""
        return json.dumps(self.to_json())

    @classmethod
    def from_line(cls, line: str) -> "NodeRequest":
        try:
            d = json.loads(line)
        except ValueError as e:
            raise ProtocolError(f"not a node request (not JSON: {e})") from None
        if not isinstance(d, dict):
            raise ProtocolError("not a node request (not a JSON object)")
        return cls.from_json(d)

    @classmethod
    def from_json(cls, d: dict) -> "NodeRequest":
        try:
            return cls(dict(d["params"]), str(d["run"]), int(d["round"]), int(d["node"]), bool(d.get("checkpoint")),
                       d.get("tokens"), d.get("tokens_dir"), bool(d.get("from_checkpoint")))
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"not a node request ({type(e).__name__}: {e})") from None

    def deployment_parameters(self) -> dict:
        """The `spes-node` flow's parameters (pipelines/node_flow.py)."""
        return {"params": self.params, "run": self.run, "r": self.round, "node": self.node, "tokens": self.tokens,
                "checkpoint": self.checkpoint, "from_checkpoint": self.from_checkpoint}
