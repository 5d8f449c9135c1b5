"""One node's part of a sync round, as a library call (no orchestration): `NodeRound(ctx, r, node, data).run()`
in three steps:

  read    global r-1 (rebuilt from deltas, or downloaded) + the node's state the global was built with
  train   sync.every_steps local steps (every rank of the node)
  commit  encoded delta upload (committed) + the node's state after round r

The round holds its `RoundContext` (spes/round/context.py: the settings, the run on storage, and the sync
method and codec built once from them), not the settings to rebuild them from. With sync.overlap the round is
given the node's `Lookahead`, and its part in it (`TrainAhead`, spes/round/lookahead.py) starts the next round
and the fetch of the next global at fixed points of `commit`. Reading the inputs is
spes/round/inputs.py; the node's housekeeping of other runs' local folders is spes/run/local_runs.py.

The node's state stays on its machine (spes/run/node_state.py) and goes to shared storage only at checkpoint
rounds, before the upload is committed (so a committed upload implies its checkpoint exists). Every byte
the node reads or writes on shared storage is counted in what it reports.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from spes.errors import NonFiniteLoss
from spes.model.names import is_expert_param
from spes.round.inputs import RoundInputs, read_inputs
from spes.round.lookahead import Assumed, Lookahead, TrainAhead
from spes.round.steps import LocalRound, Trained, share_inputs, train
from spes.run.node_state import NodeState
from spes.run.records import NodeReport, StateRef, UploadMeta
from spes.run.rounds import RunRounds
from spes.storage.store import BundleWriter
from spes.sync.deltas import EXPERTS_FILE, MOMENTS_FILE, averaged_moments, encode_upload, own_delta
from spes.train.distributed import broadcast_object, rank_and_size, shards_node
from spes.train.expert_state import remap_rows

log = logging.getLogger("spes.round.node")


def last_checkpoint_round(r: int, every: int) -> int:
    return r - r % every


def node_report(manifest: dict, where: str, seconds_save: float = 0.0) -> NodeReport:
    """What a node reports for a committed upload: its meta, plus every byte it wrote for it."""
    upload = UploadMeta.from_json(manifest["meta"], where)
    mbytes = len(json.dumps(manifest, indent=1, sort_keys=True).encode()) + 64  # manifest + COMMIT
    return NodeReport(upload.node, "ok", upload, upload.bytes_up_files + mbytes, seconds_save)


def committed_report(run: RunRounds, r: int, node: int) -> Optional[NodeReport]:
    """The node's report for round r if its upload is committed (a retry after it finished), else None."""
    store, rel = run.store, run.layout.node_dir(r, node)
    if not store.is_committed(rel):
        return None
    return node_report(store.read_manifest(rel), f"{store.url}/{rel}")


def _check_finite(losses: list[float], first_step: int, node: int, r: int, trained: dict) -> None:
    for i, v in enumerate(losses):
        if not torch.isfinite(torch.tensor(v)):
            raise NonFiniteLoss(f"node {node} round {r}: loss is {v} at step {first_step + i}; nothing committed "
                                "(lower train.optim.lr or check the data)")
    for name, t in trained.items():
        if not torch.isfinite(t).all():
            raise NonFiniteLoss(f"node {node} round {r}: {name} is not finite after step {first_step + len(losses) - 1}; "
                                "nothing committed")


@dataclass
class Reading:
    """Round r's inputs as rank 0 read them, with the storage counters before the read: every byte the round
    moves is counted from these, and the seconds the read took."""

    inputs: RoundInputs
    bytes_read0: int
    bytes_written0: int
    seconds: float


@dataclass(frozen=True)
class NodeRound(LocalRound):
    """Node `node`'s part of round r: `run()` reads its inputs, trains `sync.every_steps` local steps, commits
    its upload and returns its report.

    On a node of several ranks (torch.distributed initialized) every rank runs it: each trains on its share
    of every batch (data parallel, the model replicated or sharded: train.node_parallel), rank 0 alone reads
    and writes storage and returns the report (the others return None).

    `run(ahead)` (sync.overlap, a node of one rank): round r+1 trains on a thread while round r is sent and
    aggregated, global r is fetched as soon as it is committed, and round r+1 takes both when its inputs are
    the ones assumed (spes/round/lookahead.py)."""

    checkpoint: bool = False
    from_checkpoint: bool = False
    on_step: Optional[Callable[[int], None]] = None

    def run(self, ahead: Optional[Lookahead] = None) -> Optional[NodeReport]:
        lead = rank_and_size()[0] == 0
        done = committed_report(self.ctx.run, self.r, self.node) if lead else None
        if broadcast_object(done is not None):  # a retry after the node already finished
            return done
        if self.ctx.p.sync.overlap == "none" or rank_and_size()[1] != 1:
            ahead = None
        reading = self.read(ahead) if lead else None
        t = self.train(reading, ahead)
        trained, optim = t.trainer.upload(), t.trainer.optimizer_tensors()  # every rank: gathers under fsdp
        if reading is None:  # not rank 0
            return None
        if ahead is None:
            return self.commit(reading, t, trained, optim)
        t.trainer.release()  # copied out: the round trained ahead gets the device's memory
        if self.r >= self.ctx.p.sync.rounds:
            return self.commit(reading, t, trained, optim)
        overlap = TrainAhead(ahead, self, reading.inputs, t, optim)
        report = self.commit(reading, t, trained, optim, overlap)
        overlap.prefetch_global()
        return report

    def read(self, ahead: Optional[Lookahead]) -> Reading:
        """Rank 0: global r-1 and the node's state it was built with (from memory when trained ahead)."""
        store = self.ctx.store
        known = ahead.globals_for(self.r) if ahead is not None else None  # global r-1 fetched while round r trained
        read0 = store.bytes_read - (ahead.fetched_bytes.get(self.r - 1, 0) if ahead is not None else 0)
        written0, t0 = store.bytes_written, time.perf_counter()
        inputs = read_inputs(self.ctx, self.r, self.node, self.from_checkpoint, known)
        return Reading(inputs, read0, written0, time.perf_counter() - t0)

    def train(self, reading: Optional[Reading], ahead: Optional[Lookahead]) -> Trained:
        """Every rank: the local steps, or the round trained ahead when it assumed these inputs."""
        if ahead is not None and reading is not None:
            t = ahead.take(Assumed.of(self.ctx.name, self.ctx.p, self.r, self.node, self.data.folder, reading.inputs))
            if t is not None:
                log.info("node %d round %d: trained while round %d was synchronised", self.node, self.r, self.r - 1)
                return t
        start = share_inputs(reading.inputs if reading else None, shards_node(self.ctx.p.train.node_parallel))
        return train(self, start, self.on_step)

    def commit(self, reading: Reading, t: Trained, trained: dict[str, torch.Tensor], optim: dict[str, torch.Tensor],
               overlap: Optional[TrainAhead] = None) -> NodeReport:
        """Rank 0: encode the upload (`trained`: the trainer's upload), keep the node's state (`optim`: its
        optimizer tensors) and checkpoint it, commit the upload. With sync.overlap, `overlap` starts the next
        round as soon as the node's exact delta is known (beside the encoding) and learns the state kept."""
        t2 = time.perf_counter()
        ctx, r, node, inputs = self.ctx, self.r, self.node, reading.inputs
        p, store, layout, codec = ctx.p, ctx.store, ctx.layout, ctx.codec
        _check_finite(t.losses, (r - 1) * p.sync.every_steps, node, r, trained)
        owned, local = t.trainer.owned, inputs.local
        residual = _residual_for(inputs.state, owned)
        sent = own_delta(ctx.method, inputs.start, trained, owned) if p.sync.overlap != "none" else None
        if overlap is not None and sent is not None:
            overlap.delta_known(sent)
        files, residual = encode_upload(ctx.method, codec, inputs.start, trained, owned, residual, p.sync.error_feedback)
        if p.sync.average_optimizer_state:
            files[MOMENTS_FILE] = averaged_moments(ctx.method, optim)
        saved = local.save_state(r, t.position, optim, residual, files.get(EXPERTS_FILE, {}), owned, sent,
                                 (r - 1, inputs.prev_sha))
        if overlap is not None:
            overlap.state_kept(saved)
        if self.checkpoint:  # the same files, so the same digest: a resume can take it from either place
            store.remove(layout.state_dir(r, node))
            store.write_bundle(layout.state_dir(r, node), saved["files"], saved["meta"])
        meta = self._upload_meta(reading, t, StateRef(r, saved["digest"], self.checkpoint))
        rel = layout.node_dir(r, node)
        t_up = time.perf_counter()
        up = BundleWriter(store, rel)
        for fname, parts in files.items():
            up.add(fname, parts)
        meta.bytes_up_files = store.bytes_written - reading.bytes_written0
        meta.seconds_upload = time.perf_counter() - t_up  # the manifest's own write not in it
        manifest = up.commit(meta.to_json())
        ref = inputs.ref
        local.prune_before(min(ref.round if ref else 0, last_checkpoint_round(r, p.checkpoint.every_rounds)))
        return node_report(manifest, f"{store.url}/{rel}", time.perf_counter() - t2)

    def _upload_meta(self, reading: Reading, t: Trained, state: StateRef) -> UploadMeta:
        """What the upload says of itself: the round, its base, what the steps measured, what was read."""
        p, r, dev = self.ctx.p, self.r, t.device
        return UploadMeta(
            round=r, node=self.node, experts=list(t.trainer.owned), tokens=t.tokens, base_round=r - 1,
            base_sha256=reading.inputs.prev_sha, codec=self.ctx.codec.name, state=state,
            step_end=r * p.sync.every_steps, loss_first=t.losses[0], loss_last=t.losses[-1],
            loss_mean=sum(t.losses) / len(t.losses), losses=t.losses,
            expert_load=t.counts.cpu().tolist() if t.counts is not None else [], ranks=rank_and_size()[1],
            bytes_down=self.ctx.store.bytes_read - reading.bytes_read0, seconds_load=t.seconds_load,
            seconds_compute=t.seconds_compute, device=str(dev),
            peak_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
            state_bytes=t.state_bytes, grad_norms=t.grad_norms, lb_losses=t.lb_losses, z_losses=t.z_losses,
            timeline=t.timeline, seconds_read=reading.seconds)


def _residual_for(state: Optional[NodeState], owned: tuple[int, ...]) -> Optional[dict]:
    """The error-feedback residual the node carries, its expert rows following the experts it now owns."""
    residual = state.residual if state is not None else None
    if residual and state is not None and state.owned is not None and state.owned != owned:
        residual = {n: remap_rows(v, state.owned, owned) if is_expert_param(n) else v for n, v in residual.items()}
    return residual
