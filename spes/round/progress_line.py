"""A node's progress line: written by the node every `orchestration.log_every_steps` steps, read back by whoever
relays its output (the round's progress in the Prefect UI). No torch here: the relaying processes are light."""
from __future__ import annotations

import re
from typing import Optional

PROGRESS_LINE = re.compile(r"node (\d+) round (\d+): step (\d+)/(\d+),")


def progress_line(node: int, r: int, done: int, steps: int, loss: float, tokens: int, seconds: float) -> str:
    left = seconds / done * (steps - done)
    return (f"node {node} round {r}: step {done}/{steps}, loss {loss:.4f}, {tokens / max(seconds, 1e-9):.0f} "
            f"tokens/s, {left:.0f} s left in the round")


def parse_progress(line: str) -> Optional[tuple[int, int, int, int]]:
    """(node, round, steps done, steps) of a node's progress line, else None."""
    m = PROGRESS_LINE.search(line)
    if not m:
        return None
    node, rnd, done, steps = (int(g) for g in m.groups())
    return node, rnd, done, steps
