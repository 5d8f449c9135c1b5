"""sync.overlap one_round in time: the next round trained while this one is synchronised.

Once a node has its delta of round r (before it encodes and uploads it), its process starts round r+1 on a thread,
from what it holds in memory (global r-1 plus that delta, its optimizer state after round r). The upload of
round r, the orchestrator's aggregation and the download of global r (a second thread fetches it as soon as
it is committed, `prefetch`) then happen while round r+1 trains. When round r+1 is asked for, its inputs
are read as always (global r and the node's state that global names; global r from memory when the
prefetch got it); if they are the ones the thread assumed, the thread's result is taken, else it is dropped
and the round trains from the inputs read. Training is a function of its inputs (seeded per node and
round), so both give the same bits: the threads change when the work happens, never what it computes. Only
one thread trains at a time (torch's random generator is the process's).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from spes.errors import StorageError
from spes.round.fetch import Chain, fetch_global
from spes.round.inputs import HeldGlobal, RoundInputs
from spes.round.steps import Assignment, LocalRound, Start, Trained, train
from spes.sync.deltas import EXPERTS_FILE, experts_file, with_own_delta
from spes.train.expert_state import expert_steps

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
        self._globals: dict[int, HeldGlobal] = {}
        """round -> the globals held in memory (the one round r's delta is on top of, and the prefetched global r)."""
        self._fetching: Optional[tuple[int, threading.Thread, threading.Event]] = None
        self.fetched_bytes: dict[int, int] = {}
        """round -> bytes the prefetch of that global read (counted in the next round's download)."""

    def remember(self, r: int, held: HeldGlobal) -> None:
        """Keep global r in memory for the next round's inputs (and only it, and what a prefetch adds)."""
        self._stop_fetching()
        self._globals, self.fetched_bytes = {r: held}, {}

    def prefetch(self, r: int, ready: Callable[[], bool], fetch: Callable[[], tuple[HeldGlobal, int]],
                 deadline: float, poll_s: float = 0.2) -> None:
        """Fetch global r on a thread as soon as `ready()` says it is committed (polled until `deadline`):
        `fetch()` gives it and the bytes it read. A failure leaves it to the next round's own read."""
        stop = threading.Event()

        def run() -> None:
            try:
                while not stop.is_set() and time.time() < deadline:
                    if ready():
                        held, nbytes = fetch()
                        self._globals[r], self.fetched_bytes[r] = held, nbytes
                        return
                    stop.wait(poll_s)
            except Exception as e:  # storage unreachable, a damaged delta: the round's own read says so
                log.info("prefetch of global %d failed (%s: %s); the next round reads it itself", r,
                         type(e).__name__, e)

        thread = threading.Thread(target=run, name=f"prefetch-global-{r}", daemon=True)
        self._fetching = (r, thread, stop)
        thread.start()

    def globals_for(self, r: int) -> dict[int, HeldGlobal]:
        """The globals in memory for round r's inputs: waits for the prefetch of global r-1 (committed
        before round r is asked for); a prefetch of another global is stopped."""
        if self._fetching is not None:
            target, thread, stop = self._fetching
            if target != r - 1:
                stop.set()
            thread.join()
            self._fetching = None
        return dict(self._globals)

    def _stop_fetching(self) -> None:
        if self._fetching is not None:
            self._fetching[2].set()
            self._fetching[1].join()
            self._fetching = None

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

    def settle(self, state_digest: str) -> None:
        """The digest of the state the round trained ahead continues from, once that state is kept (it starts
        before, beside the encoding; with no digest it matches no round asked for)."""
        if self._assumed is not None:
            self._assumed = dataclasses.replace(self._assumed, state_digest=state_digest)

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


class TrainAhead:
    """Round r's part in the lookahead, the strategy a node round is given with sync.overlap: round r+1 starts
    on a thread once round r's exact delta is known (`delta_known`), learns the state it continues from once
    that is kept (`state_kept`), and global r is fetched on a thread once committed (`prefetch_global`)."""

    def __init__(self, ahead: Lookahead, local: LocalRound, inputs: RoundInputs, t: Trained,
                 optim: dict[str, torch.Tensor]):
        self.ahead, self.local, self.inputs, self.t, self.optim = ahead, local, inputs, t, optim
        self.saved: Optional[dict] = None

    def delta_known(self, sent: dict[str, torch.Tensor]) -> None:
        """Start round r+1 from what round r left in memory: global r-1 + the node's delta of round r (the start
        read_inputs builds for round r+1 from the same state), its optimizer state, same experts; the state's
        digest is settled once the state is kept (until then the result matches no round)."""
        local, before, t = self.local, self.inputs, self.t
        r, owned = local.r + 1, t.trainer.owned
        nxt = LocalRound(local.ctx, r, local.node, local.data)
        start = Start(with_own_delta(local.ctx.method, before.prev, sent, owned), self.optim,
                      Assignment(before.model_config, t.position, owned, before.slot, expert_steps(self.optim)))
        assumed = Assumed(local.ctx.name, local.ctx.p, r, local.node, local.data.folder, "", (r - 2, before.prev_sha),
                          owned, before.slot, t.position, before.model_config, torch.get_num_threads())
        self.ahead.start(assumed, lambda: train(nxt, start, log_progress=False))

    def state_kept(self, saved: dict) -> None:
        self.saved = saved
        self.ahead.settle(saved["digest"])

    def prefetch_global(self) -> None:
        """Fetch global r on a thread once it is committed, from global r-1 in memory and the delta (its own
        experts' rows from what it just uploaded), for round r+1's inputs."""
        assert self.saved is not None, "the state is kept before the upload is committed"
        ctx, r, node, inputs = self.local.ctx, self.local.r, self.local.node, self.inputs
        store, layout = ctx.store, ctx.layout
        self.ahead.remember(r - 1, HeldGlobal(inputs.prev_sha, inputs.prev))
        entry = self.saved["manifest"]["files"].get(EXPERTS_FILE)
        own = {experts_file(node): (entry["sha256"], self.saved["files"][EXPERTS_FILE])} if entry else None

        def fetch() -> tuple[HeldGlobal, int]:
            apart = store.counted_apart()  # its bytes alone, whatever else reads meanwhile
            mark, manifest = apart.read_marked(layout.global_dir(r))
            tensors, sha = fetch_global(ctx, r, manifest, Chain((r - 1, inputs.prev_sha), lambda: inputs.prev, own),
                                        apart)
            if inputs.local.save_base(r, tensors) != sha:  # kept here too, out of the next round's own time
                raise StorageError(f"node {node}: global {r} as kept here does not hash to the committed {sha[:12]}")
            return HeldGlobal(sha, tensors, mark, manifest), apart.bytes_read

        self.ahead.prefetch(r, lambda: store.is_committed(layout.global_dir(r)), fetch,
                            time.time() + ctx.p.orchestration.round_timeout_s)


def _difference(a: Optional[Assumed], b: Assumed) -> str:
    if a is None:
        return "none"
    keys = [k for k in Assumed.__dataclass_fields__ if getattr(a, k) != getattr(b, k)]
    return ", ".join(k.replace("_", " ") for k in keys)
