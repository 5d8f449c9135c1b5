"""One node's part of a sync round, as a library call (no orchestration), in three steps:

  read_inputs  global r-1 (rebuilt from deltas, or downloaded) + the node's state the global was built with
  train        sync.every_steps local steps (every rank of the node)
  commit       encoded delta upload (committed) + the node's state after round r

Each step takes the round's `RoundContext` (spes/round/context.py: the settings, the run on storage, and the
sync method and codec built once from them), not the settings to rebuild them from. Reading the inputs is
spes/round/inputs.py; the node's housekeeping of other runs' local folders is spes/run/local_runs.py.

The node's state stays on its machine (spes/run/node_state.py) and goes to shared storage only at checkpoint
rounds, before the upload is committed (so a committed upload implies its checkpoint exists). Every byte
the node reads or writes on shared storage is counted in what it reports.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Callable, Optional

import torch

from spes.data.tokens import TokenData
from spes.errors import NonFiniteLoss, StorageError
from spes.model.names import is_expert_param
from spes.round.context import RoundContext
from spes.round.fetch import fetch_global
from spes.round.inputs import HeldGlobal, RoundInputs, read_inputs
from spes.round.lookahead import Assumed, Lookahead
from spes.round.steps import Assignment, Trained, share_inputs, train
from spes.run.records import NodeReport, StateRef, UploadMeta
from spes.run.rounds import RunRounds
from spes.storage.store import BundleWriter
from spes.sync.deltas import (
    EXPERTS_FILE,
    MOMENTS_FILE,
    averaged_moments,
    encode_upload,
    experts_file,
    own_delta,
    with_own_delta,
)
from spes.train.distributed import broadcast_object, rank_and_size, shards_node
from spes.train.expert_state import expert_steps, remap_rows

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


def commit(ctx: RoundContext, r: int, node: int, inputs: RoundInputs, t: Trained, trained: dict[str, torch.Tensor],
           optim: dict[str, torch.Tensor], checkpoint: bool, bytes_read0: int, bytes_written0: int,
           seconds_read: float = 0.0, on_delta: Optional[Callable[[dict], None]] = None,
           on_staged: Optional[Callable[[dict], None]] = None) -> NodeReport:
    """Rank 0: encode the upload (`trained`: the trainer's upload), keep the node's state (`optim`: its
    optimizer tensors) and checkpoint it, commit the upload. `seconds_read`: what reading the inputs took.
    With sync.overlap, `on_delta(the node's exact delta)` is called as soon as it is known (the next round
    starts there, beside the encoding) and `on_staged(saved state)` once the state is kept here."""
    t2 = time.perf_counter()
    p, store, layout, codec = ctx.p, ctx.store, ctx.layout, ctx.codec
    first_step = (r - 1) * p.sync.every_steps
    _check_finite(t.losses, first_step, node, r, trained)
    state, local = inputs.state, inputs.local
    residual = state.residual if state is not None else None
    if residual and state is not None and state.owned is not None and state.owned != t.trainer.owned:  # expert rows follow the experts
        residual = {n: remap_rows(v, state.owned, t.trainer.owned) if is_expert_param(n) else v
                    for n, v in residual.items()}
    owned = t.trainer.owned
    sent = own_delta(ctx.method, inputs.start, trained, owned) if p.sync.overlap != "none" else None
    if on_delta is not None and sent is not None:
        on_delta(sent)
    files, residual = encode_upload(ctx.method, codec, inputs.start, trained, owned, residual, p.sync.error_feedback)
    if p.sync.average_optimizer_state:
        files[MOMENTS_FILE] = averaged_moments(ctx.method, optim)
    saved = local.save_state(r, t.position, optim, residual, files.get(EXPERTS_FILE, {}), owned, sent,
                             (r - 1, inputs.prev_sha))
    if on_staged is not None:
        on_staged(saved)
    if checkpoint:  # the same files, so the same digest: a resume can take it from either place
        store.remove(layout.state_dir(r, node))
        store.write_bundle(layout.state_dir(r, node), saved["files"], saved["meta"])
    dev = t.device
    meta = UploadMeta(
        round=r, node=node, experts=list(t.trainer.owned), tokens=t.tokens, base_round=r - 1,
        base_sha256=inputs.prev_sha, codec=codec.name, state=StateRef(r, saved["digest"], checkpoint),
        step_end=r * p.sync.every_steps, loss_first=t.losses[0], loss_last=t.losses[-1],
        loss_mean=sum(t.losses) / len(t.losses), losses=t.losses,
        expert_load=t.counts.cpu().tolist() if t.counts is not None else [], ranks=rank_and_size()[1],
        bytes_down=store.bytes_read - bytes_read0, seconds_load=t.seconds_load, seconds_compute=t.seconds_compute,
        device=str(dev), peak_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        state_bytes=t.state_bytes, grad_norms=t.grad_norms, lb_losses=t.lb_losses, z_losses=t.z_losses,
        timeline=t.timeline)
    rel = layout.node_dir(r, node)
    t_up = time.perf_counter()
    up = BundleWriter(store, rel)
    for fname, parts in files.items():
        up.add(fname, parts)
    meta.bytes_up_files = store.bytes_written - bytes_written0
    meta.seconds_read, meta.seconds_upload = seconds_read, time.perf_counter() - t_up  # the manifest's own write not in it
    manifest = up.commit(meta.to_json())
    ref = inputs.ref
    local.prune_before(min(ref.round if ref else 0, last_checkpoint_round(r, p.checkpoint.every_rounds)))
    return node_report(manifest, f"{store.url}/{rel}", time.perf_counter() - t2)


def node_round(ctx: RoundContext, r: int, node: int, data: TokenData,
               on_step: Optional[Callable[[int], None]] = None, checkpoint: bool = False,
               from_checkpoint: bool = False, ahead: Optional[Lookahead] = None) -> Optional[NodeReport]:
    """Node `node`'s part of round r: read its inputs, train `sync.every_steps` local steps, commit its upload;
    returns its report.

    On a node of several ranks (torch.distributed initialized) every rank calls this: each trains on its
    share of every batch (data parallel, the model replicated or sharded: train.node_parallel), rank 0
    alone reads and writes storage and returns the report (the others return None).

    `ahead` (sync.overlap, a node of one rank): round r+1 trains on a thread while round r is sent and
    aggregated, global r is fetched as soon as it is committed, and round r+1 takes both when its inputs
    are the ones assumed (spes/round/lookahead.py)."""
    lead = rank_and_size()[0] == 0
    p, store = ctx.p, ctx.store
    done = committed_report(ctx.run, r, node) if lead else None
    if broadcast_object(done is not None):  # a retry after the node already finished
        return done
    ahead = ahead if ahead is not None and p.sync.overlap != "none" and rank_and_size()[1] == 1 else None
    known = ahead.globals_for(r) if ahead is not None else None  # global r-1 fetched while round r trained
    read0, written0 = store.bytes_read, store.bytes_written
    if ahead is not None:
        read0 -= ahead.fetched_bytes.get(r - 1, 0)
    t_read = time.perf_counter()
    inputs = read_inputs(ctx, r, node, from_checkpoint, known) if lead else None
    t_read = time.perf_counter() - t_read
    t = ahead.take(Assumed.of(ctx.name, ctx.p, r, node, data.folder, inputs)) if ahead is not None and inputs is not None else None
    if t is None:
        start, optim, job = share_inputs(inputs, shards_node(p.train.node_parallel))
        t = train(ctx, r, node, data, start, optim, job, on_step)
    else:
        log.info("node %d round %d: trained while round %d was synchronised", node, r, r - 1)
    trained, optim = t.trainer.upload(), t.trainer.optimizer_tensors()  # every rank: gathers under fsdp
    if inputs is None:  # not rank 0
        return None
    if ahead is not None:  # copied out: the round trained ahead gets the device's memory
        t.trainer.release()
    if ahead is None or r >= p.sync.rounds:
        return commit(ctx, r, node, inputs, t, trained, optim, checkpoint, read0, written0, t_read)
    staged: dict = {}

    def on_delta(sent: dict) -> None:  # round r+1 trains while round r is encoded, sent and aggregated
        _train_ahead(ctx, r + 1, node, data, inputs, t, sent, optim, ahead)

    def on_staged(saved: dict) -> None:  # the state round r+1 trained ahead continues from
        staged.update(saved=saved)
        ahead.settle(saved["digest"])

    report = commit(ctx, r, node, inputs, t, trained, optim, checkpoint, read0, written0, t_read, on_delta,
                    on_staged)
    _prefetch(ctx, r, node, inputs, staged["saved"], ahead)
    return report


def _prefetch(ctx: RoundContext, r: int, node: int, inputs: RoundInputs, saved: dict, ahead: Lookahead) -> None:
    """Fetch global r on a thread once it is committed, from global r-1 in memory and the delta (its own
    experts' rows from what it just uploaded), for round r+1's inputs."""
    store, layout = ctx.store, ctx.layout
    ahead.remember(r - 1, HeldGlobal(inputs.prev_sha, inputs.prev))
    entry = saved["manifest"]["files"].get(EXPERTS_FILE)
    own = {experts_file(node): (entry["sha256"], saved["files"][EXPERTS_FILE])} if entry else None

    def fetch() -> tuple[HeldGlobal, int]:
        apart = store.counted_apart()  # its bytes alone, whatever else reads meanwhile
        mark, manifest = apart.read_marked(layout.global_dir(r))
        tensors, sha = fetch_global(apart, layout, r, manifest, ctx.codec, ctx.method, (r - 1, inputs.prev_sha),
                                    lambda: inputs.prev, own)
        if inputs.local.save_base(r, tensors) != sha:  # kept here too, out of the next round's own time
            raise StorageError(f"node {node}: global {r} as kept here does not hash to the committed {sha[:12]}")
        return HeldGlobal(sha, tensors, mark, manifest), apart.bytes_read

    ahead.prefetch(r, lambda: store.is_committed(layout.global_dir(r)), fetch,
                   time.time() + ctx.p.orchestration.round_timeout_s)


def _train_ahead(ctx: RoundContext, r: int, node: int, data: TokenData, before: RoundInputs, t: Trained,
                 sent: dict[str, torch.Tensor], optim: dict[str, torch.Tensor], ahead: Lookahead) -> None:
    """Start round r on a thread from what round r-1 left in memory: global r-2 + the node's delta of round
    r-1 (the start read_inputs builds for round r from the same state), its optimizer state, same experts;
    the state's digest is settled once the state is kept (until then the result matches no round)."""
    owned = t.trainer.owned
    start = with_own_delta(ctx.method, before.prev, sent, owned)
    job = Assignment(before.model_config, t.position, owned, before.slot, expert_steps(optim))
    assumed = Assumed(ctx.name, ctx.p, r, node, data.folder, "", (r - 2, before.prev_sha), owned, before.slot,
                      t.position, before.model_config, torch.get_num_threads())
    ahead.start(assumed, lambda: train(ctx, r, node, data, start, optim, job, log_progress=False))

