"""The aggregator: committed node uploads of round r + global r-1 -> delta bundle r + global r.

Streams tensor by tensor: it holds one tensor of each input at a time (the previous global, its outer state
and residual, each node's upload), never a whole upload, and hashes every byte it reads and writes on the
way (on helper threads). It knows no method's rules: the sync method says which tensors are averaged, what
state it keeps per tensor (streamed beside the global in outer.safetensors) and how a mean delta becomes the
global's change; in a merging round it hands each layer's expert tensors to the method's `merge` hook.
The expert rows of a non-merging round are not copied: the delta refers to the owners' uploads. The global
it committed last stays in memory (one model), so the next round need not read it.

Uploads that fail verification (truncated, altered, a delta against another base, another codec) are
moved aside to `runs/<run>/rejected/` with the file named in the log; with `rerun_rejected` the call then
raises UploadsRejected (the caller re-runs those nodes), else they are left out under the quorum.
"""
from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Optional

import torch

from spes.errors import QuorumError, UploadsRejected
from spes.round.attempt import RoundAttempt
from spes.round.context import RoundContext
from spes.round.uploads import BadUpload, RoundBase, committed_uploads
from spes.run.layout import MODEL_FILE
from spes.run.membership import membership_of, next_membership, read_requests, stamp
from spes.run.records import DeltaMeta, GlobalMeta
from spes.run.rounds import next_index
from spes.storage.store import BundleWriter

log = logging.getLogger("spes.round.aggregator")


class Aggregator:
    """Aggregates the rounds of one run, holding the global it committed last (one model in memory), so the
    next round need not read it back; its first round after a start reads global r-1 from storage. It works
    with the run's context (spes/round/context.py): with the flow's, it shares the global manifests the
    driver and retention read, and the sync method and codec built once for the run."""

    def __init__(self, ctx: RoundContext):
        self.ctx, self.p, self.store, self.run, self.layout = ctx, ctx.p, ctx.store, ctx.run, ctx.layout
        self.method, self.codec = ctx.method, ctx.codec
        self._held: Optional[tuple[tuple[int, str], dict]] = None  # ((round, sha256), tensors)

    def hold(self, r: int) -> None:
        """Load committed global r as the previous global, as after committing r (benchmarks time a warm round)."""
        b = self.store.read_bundle(self.layout.global_dir(r), [MODEL_FILE])
        self._held = ((r, b.manifest["files"][MODEL_FILE]["sha256"]), dict(b.files[MODEL_FILE]))

    def _take_held(self, r: int, sha: str) -> Optional[dict]:
        held, self._held = self._held, None  # consumed by the attempt: a failed one reads from storage next
        return held[1] if held is not None and held[0] == (r, sha) else None

    def _quarantine(self, r: int, node: int, why: str) -> None:
        dest = self.layout.rejected_dir(r, node, time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6])
        log.error("round %d: upload of node %d rejected (%s); moved to %s", r, node, why, dest)
        self.store.move(self.layout.node_dir(r, node), dest)

    def aggregate(self, r: int, min_nodes: Optional[int] = None, rerun_rejected: bool = False) -> GlobalMeta:
        """Combine the committed node uploads of round r into delta r and global r (with merging when due).
        Uploads that fail verification are moved aside; with `rerun_rejected` this raises UploadsRejected
        (the caller re-runs those nodes), else they are left out under the quorum."""
        store, layout, method = self.store, self.layout, self.method
        if store.is_committed(layout.global_dir(r)):
            return self.run.global_meta(r)
        t0 = time.perf_counter()
        store.remove(layout.delta_dir(r))  # a delta of a global that was never committed (crash in between)
        prev, prev_meta = self.run.global_manifest(r - 1), self.run.global_meta(r - 1)
        membership = membership_of(prev_meta, method)
        members = membership.members
        need = min(min_nodes if min_nodes is not None else len(members), len(members))
        rejected: dict[int, str] = {}
        base = RoundBase(r, prev, prev_meta, membership)
        fit = committed_uploads(self.ctx, base, rejected)
        uploads = fit.uploads
        while True:
            for i in list(rejected):
                if i in uploads or store.exists(layout.node_dir(r, i)):
                    uploads.pop(i, None)
                    self._quarantine(r, i, rejected[i])
            if rejected and rerun_rejected:
                raise UploadsRejected(rejected)
            if len(uploads) < need:
                raise QuorumError(f"round {r}: only nodes {sorted(uploads)} committed"
                                  + (f" ({len(rejected)} rejected)" if rejected else "")
                                  + f", quorum is {need} of {len(members)} (members {members})")
            attempt = RoundAttempt(self.ctx, base, fit, self._take_held(r - 1, base.sha256))
            try:
                with one_torch_thread():
                    written = attempt.run()
                break
            except BadUpload as e:
                rejected[e.node] = e.msg
        return self._commit(attempt, written, rejected, t0)

    def _commit(self, attempt: RoundAttempt, written: tuple[BundleWriter, BundleWriter, dict], rejected: dict[int, str],
                t0: float) -> GlobalMeta:
        """Delta r, then global r with its meta (the next round's membership, the node states, the index)."""
        p, store, layout, method = self.p, self.store, self.layout, self.method
        delta, glob, expert_files = written
        r, prev_meta, membership = attempt.r, attempt.base.meta, attempt.base.membership
        uploads, metas = attempt.contributions.uploads, attempt.contributions.metas
        base_sha = attempt.base.sha256
        num_experts = prev_meta.model_config.get("num_experts", 0)
        members = membership.members
        new_sha = glob.entries[MODEL_FILE]["sha256"]
        states = dict(prev_meta.node_states)
        for i in uploads:
            states[i] = metas[i].state
        change = next_membership(membership, method, num_experts, r, sorted(uploads),
                                 read_requests(store, layout), p.orchestration.evict_after_rounds)
        for i in change.departed:  # a node that comes back joins anew, from a fresh state
            states.pop(i, None)
        for line in change.changes:
            log.warning("round %d: %s", r, line)
        delta.commit(DeltaMeta(round=r, base_round=r - 1, base_sha256=base_sha, global_sha256=new_sha,
                               codec=p.sync.codec, expert_files=expert_files, merged=attempt.merging).to_json())
        meta = GlobalMeta(
            round=r, step=r * p.sync.every_steps, method=method.name, model_config=prev_meta.model_config,
            contributors=sorted(uploads), missing=[i for i in members if i not in uploads],
            rejected=rejected, merge_alpha=attempt.alpha, merged=attempt.merging,
            node_loss={i: metas[i].loss_mean for i in uploads}, node_states=states,
            codec=p.sync.codec, seconds_aggregate=time.perf_counter() - t0,
            index=next_index(prev_meta.index or self.run.index(r - 1), r, states),
            run_id=prev_meta.run_id, fingerprint=prev_meta.fingerprint, total_steps=p.sync.total_steps,
            membership=change.membership, membership_changes=change.changes)
        stamp(store, layout, change.stamped)  # before the commit: a retry or a recomputed round applies them at r
        self.run.committed_global(r, glob.commit(meta.to_json()))
        self._held = ((r, new_sha), attempt.new_model)
        return meta


def aggregate_round(ctx: RoundContext, r: int, min_nodes: Optional[int] = None,
                    rerun_rejected: bool = False) -> GlobalMeta:
    """One round's aggregation without a held global (tests, scripts): reads global r-1 from storage."""
    return Aggregator(ctx).aggregate(r, min_nodes, rerun_rejected)


@contextlib.contextmanager
def one_torch_thread():
    """Aggregation is memory-bound elementwise work; the other cores are better spent on the sha256 helper
    threads (spes/storage/tensorio.py) than on torch's intra-op threads, which would compete with them."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
