"""A node's progress, as an event: written by the node every `orchestration.log_every_steps` steps as one
JSON line after a fixed marker, read back by whoever relays its output (the round's progress in the Prefect
UI, the node's heartbeat), which renders it for people. The relays read fields, never wording: a change of
the sentence cannot turn the UI's progress off. No torch here: the relaying processes are light.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Optional

MARKER = "spes-event "
"""What precedes the event's JSON on its line (log formatting may come before it)."""


@dataclass(frozen=True)
class Progress:
    node: int
    round: int
    done: int
    """Local steps done this round."""
    steps: int
    loss: float
    tokens: int
    seconds: float

    @property
    def fraction(self) -> float:
        return self.done / self.steps

    def fields(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        """The event as the node writes it."""
        return MARKER + json.dumps({"event": "progress", **self.fields()}, sort_keys=True)

    def sentence(self) -> str:
        """The event for people (the relays log this)."""
        left = self.seconds / max(self.done, 1) * (self.steps - self.done)
        return (f"node {self.node} round {self.round}: step {self.done}/{self.steps}, loss {self.loss:.4f}, "
                f"{self.tokens / max(self.seconds, 1e-9):.0f} tokens/s, {left:.0f} s left in the round")


def progress_of(fields: object) -> Optional[Progress]:
    """A progress event from its fields as they travelled (a heartbeat's JSON), else None (damaged or absent)."""
    if not isinstance(fields, dict):
        return None
    try:
        event = Progress(**fields)
    except TypeError:
        return None
    numbers = (event.node, event.round, event.done, event.steps, event.tokens, event.loss, event.seconds)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers) or event.steps <= 0:
        return None
    return event


def parse_progress(line: str) -> Optional[Progress]:
    """The progress event on a line of a node's output, else None (any other line, or a damaged event)."""
    at = line.find(MARKER)
    if at < 0:
        return None
    try:
        d = json.loads(line[at + len(MARKER):])
        if d.pop("event") != "progress":
            return None
        return progress_of(d)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
