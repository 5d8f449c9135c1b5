"""One sync round with its policy, whatever runs the nodes (Prefect tasks, processes, a test's loop):

    run_nodes(all nodes)  ->  aggregate (an upload that fails verification: its node runs again, once)
        ->  held-out loss of the committed global (when due)  ->  the round's record  ->  retention

The Prefect flow (pipelines/round.py), the tests and the benchmarks all call `run_round`, so what they test
and measure is the real round.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

from spes.config.ownership import planned_changes
from spes.config.schema import Params
from spes.data.tokens import TokenData
from spes.errors import QuorumError, UploadsRejected
from spes.eval.heldout import heldout_loss, heldout_windows
from spes.round.context import RoundContext
from spes.run.membership import membership_of, request_planned
from spes.run.records import GlobalMeta, NodeReport, RoundRecord
from spes.run.run import Run
from spes.train.schedule import stable_end

log = logging.getLogger("spes.round")

NodeRunner = Callable[[list[int], bool], dict[int, NodeReport]]
"""(nodes, checkpoint) -> each node's report; a node that failed or timed out reports that status."""
Aggregate = Callable[[bool], GlobalMeta]
"""(rerun_rejected) -> the committed global's meta (raises UploadsRejected when asked to)."""


def checkpoint_due(p: Params, r: int, stage_last: int) -> bool:
    """Nodes also write their state to shared storage at this round: every checkpoint.every_rounds, and at
    the last round of a stage and of the run (a resume from any machine can start there)."""
    return r % p.checkpoint.every_rounds == 0 or r == stage_last or r == p.sync.rounds


def heldout_due(p: Params, r: int) -> bool:
    return bool(p.eval.every_rounds) and r % p.eval.every_rounds == 0


class HeldOutProbe:
    """Held-out loss of committed globals on eval.round_batches batches of the held-out split, their windows
    spread over it (eval.round_windows), and the round's other metrics of that score, by name (`METRICS`):
    a new per-round metric is a name here and, if the score does not compute it yet, a line in
    spes/eval/heldout.py; the round's record, TensorBoard and the round's table in the UI take it by name."""

    METRICS = {"heldout_accuracy": "accuracy", "heldout_se": "se"}
    """record metric name -> the held-out score's key."""

    def __init__(self, p: Params, tokens_dir: Optional[str] = None):
        self.p = p
        self.tokens_dir = tokens_dir or os.path.join(p.artifacts_dir, "tokens")
        self._data: Optional[TokenData] = None

    def __call__(self, run: Run, r: int) -> dict:
        """heldout_loss's result: the loss, each window's (`per_window`) and the named `metrics`."""
        if self._data is None:
            self._data = TokenData.open(self.tokens_dir)
        e = self.p.eval
        model, _ = run.load_model(r)
        ev = heldout_loss(model, self._data.val, e.batch_size, e.seq_len,
                          starts=heldout_windows(e, self._data, per_round=True))
        return dict(ev, metrics={name: ev[key] for name, key in self.METRICS.items()})


def resume_point(p: Params, run: Run, resume_round, has_local_state=None) -> int:
    """The first round to run: after a damaged latest round is set aside and, with the wsd schedule, after the
    rounds past the common stable phase of an extended (or shortened) run are set aside, the round after
    the latest resumable one (or after `resume_round`). See Run.resolve_start."""
    if resume_round in (None, "latest"):
        run.set_aside_damaged()
        _align_schedule(p, run)
    return run.resolve_start(resume_round, has_local_state)


def _align_schedule(p: Params, run: Run) -> None:
    """wsd: rounds whose steps all ran at the stable rate under both the run's old and new total are the same
    in both; later ones are recomputed."""
    o, s = p.train.optim, p.sync
    latest = run.latest_round()
    if o.schedule != "wsd" or not latest:
        return
    old_total, new_total = run.global_meta(latest).total_steps, s.total_steps
    if not old_total or old_total == new_total:
        return
    keep = min(stable_end(o, old_total), stable_end(o, new_total)) // s.every_steps
    if latest > keep:
        moved = run.supersede_after(keep)
        log.warning("run %s: the schedule now runs %d steps, not %d (wsd): rounds %s decayed under the old total and "
                    "were set aside; rounds up to %d ran at the stable rate and are kept", run.name, new_total,
                    old_total, moved, keep)


def round_members(ctx: RoundContext, r: int) -> list[int]:
    """The nodes that train round r: its membership, recorded in global r-1 (spes/run/membership.py)."""
    return membership_of(ctx.run.global_meta(r - 1), ctx.method).members


def run_round(ctx: RoundContext, r: int, run_nodes: NodeRunner, aggregate: Aggregate, checkpoint: bool,
              heldout: Optional[Callable[[Run, int], dict]] = None) -> RoundRecord:
    """Round r from start to record (see the module docstring); returns its record."""
    t0 = time.time()
    p, run = ctx.p, ctx.run
    o = p.orchestration
    if o.membership_plan:
        request_planned(run.store, run.name, ctx.method,
                        planned_changes(o.membership_plan, p.sync.rounds, p.sync.num_nodes), r)
    rows = run_nodes(round_members(ctx, r), checkpoint)
    try:
        try:
            agg = aggregate(True)
        except UploadsRejected as e:  # a committed upload failed verification: that node's failure; run it again
            log.error("round %d: %s; re-running nodes %s", r, e, sorted(e.nodes))
            rows.update(run_nodes(sorted(e.nodes), checkpoint))
            agg = aggregate(False)
    except QuorumError as e:  # say why the missing nodes are missing
        causes = [f"node {n.node}: {n.status}" + (f" ({n.error})" if n.error else "")
                  for _, n in sorted(rows.items()) if not n.ok]
        raise QuorumError(f"{e}" + (f"; {'; '.join(causes)}" if causes else "")) from None
    wall = time.time() - t0
    loss, windows, heldout_s, metrics = None, None, 0.0, {}
    if heldout is not None and heldout_due(p, r):
        t1 = time.time()
        ev = heldout(run, r)
        loss, windows, metrics = ev["loss"], ev.get("per_window"), ev.get("metrics", {})
        heldout_s = time.time() - t1
    reports = [rows[i] for i in sorted(rows)]
    record = RoundRecord(round=r, wall_s=wall, max_node_compute_s=max((n.seconds_compute for n in reports), default=0.0),
                         nodes=reports, aggregate=agg, heldout_loss=loss, heldout_s=heldout_s,
                         tokens=sum(n.tokens for n in reports), heldout_windows=windows, metrics=metrics)
    run.write_record(r, record)
    dropped = run.retire(r, p.storage.keep_rounds, p.checkpoint.keep_last, p.sync.overlap != "none")
    if dropped:
        log.info("retention: models of rounds %s deleted (records kept)", dropped)
    return record
