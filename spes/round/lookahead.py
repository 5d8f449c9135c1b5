"""sync.overlap one_round in time: the next round trained while this one is synchronised.

Right after a node commits round r, its process starts round r+1 on a thread, from what it holds in memory
(global r-1 plus its delta of round r, its optimizer state after round r), while the orchestrator
aggregates round r. When round r+1 is asked for, its inputs are read from storage as always (global r, the
state global r says the node continues from); if they are the ones the thread assumed, the thread's result
is taken, else it is dropped and the round trains from the inputs read. Training is a function of its
inputs (seeded per node and round), so both give the same bits: the thread changes when the work happens,
never what it computes. Only one thread trains at a time (torch's random generator is the process's).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from spes.round.inputs import RoundInputs

log = logging.getLogger("spes.round.lookahead")


@dataclass(frozen=True)
class Assumed:
    """What a round trained ahead took as its inputs; the round asked for must match it whole."""

    run: str
    params: Any
    round: int
    node: int
    tokens: str
    state_digest: str
    """The node's state it continued from (its digest covers its exact delta and the global that is on top of)."""
    sent_base: tuple[int, str]
    owned: tuple[int, ...]
    slot: int
    position: int
    model_config: dict
    threads: int
    """torch's intra-op threads: float sums depend on them (nothing in a node process may change them while a
    round trains ahead; a request that sets another count gets its round trained again)."""

    @classmethod
    def of(cls, run: str, params: Any, r: int, node: int, tokens: str, inputs: RoundInputs) -> "Assumed":
        """What round r's inputs (read from storage) are, in the terms a round trained ahead is checked by."""
        state = inputs.state
        return cls(run, params, r, node, tokens, state.digest if state else "",
                   state.sent_base if state and state.sent_base else (-1, ""), inputs.owned, inputs.slot,
                   inputs.position, inputs.model_config, torch.get_num_threads())


class Lookahead:
    """At most one round trained ahead, on its own thread."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._assumed: Optional[Assumed] = None
        self._result: Any = None
        self._error: Optional[BaseException] = None

    def start(self, assumed: Assumed, work: Callable[[], Any]) -> None:
        self.drop()

        def run() -> None:
            try:
                self._result = work()
            except BaseException as e:  # kept: the round asked for then trains itself and meets it there
                self._error = e

        self._assumed = assumed
        self._thread = threading.Thread(target=run, name=f"node-{assumed.node}-round-{assumed.round}-ahead",
                                        daemon=True)
        self._thread.start()

    def take(self, wanted: Assumed) -> Optional[Any]:
        """The result trained ahead if it is for `wanted` (waiting for its last steps), else None; either way
        no thread trains after this returns."""
        if self._thread is None:
            return None
        assumed = self._assumed
        self._thread.join()
        result, error = self._result, self._error
        self._reset()
        if assumed != wanted:
            log.info("node %d round %d: the round trained ahead assumed other inputs (%s); training it again",
                     wanted.node, wanted.round, _difference(assumed, wanted))
            return None
        if error is not None:
            log.info("node %d round %d: training ahead failed (%s: %s); training it again", wanted.node,
                     wanted.round, type(error).__name__, error)
            return None
        return result

    def drop(self) -> None:
        if self._thread is not None:
            self._thread.join()  # a thread cannot be stopped: its steps finish first
        self._reset()

    def _reset(self) -> None:
        self._thread, self._assumed, self._result, self._error = None, None, None, None


def _difference(a: Optional[Assumed], b: Assumed) -> str:
    if a is None:
        return "none"
    keys = [k for k in Assumed.__dataclass_fields__ if getattr(a, k) != getattr(b, k)]
    return ", ".join(k.replace("_", " ") for k in keys)
