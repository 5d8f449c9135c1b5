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
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from spes.config.schema import Params, model_for_training
from spes.data.tokens import BatchStream, TokenData
from spes.errors import NonFiniteLoss
from spes.model.names import is_expert_param
from spes.model.transformer import CausalLM
from spes.round.context import RoundContext
from spes.round.inputs import RoundInputs, read_inputs
from spes.round.lookahead import Assumed, Lookahead
from spes.round.progress_line import Progress
from spes.run.records import NodeReport, StateRef, UploadMeta
from spes.run.rounds import RunRounds
from spes.storage.store import BundleWriter
from spes.sync.deltas import EXPERTS_FILE, MOMENTS_FILE, averaged_moments, encode_upload, own_delta, with_own_delta
from spes.train.devices import resolve_device
from spes.train.distributed import broadcast_object, broadcast_tensors, rank_and_size, shards_node
from spes.train.expert_state import expert_steps, remap_rows
from spes.train.trainer import Trainer, build_node_trainer

log = logging.getLogger("spes.round.node")


def node_seed(seed: int, node: int, r: int) -> int:
    """Torch RNG seed of node `node` in round r: distinct per (run seed, node, round), so any use of
    randomness in a step (dropout, noise) replays exactly on a retry or resume. Spaced by primes."""
    return seed * 100003 + node * 1009 + r


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
class Assignment:
    """What every rank of the node needs to know about its round besides tensors."""

    model_config: dict
    position: int
    owned: tuple[int, ...]
    slot: int
    expert_steps: dict[int, float]


def _share(inputs: Optional[RoundInputs], sharded: bool) -> tuple[Optional[dict], Optional[dict], Assignment]:
    """(the model to start from, optimizer tensors, the round's assignment) on every rank of the node. A sharded node
    (fsdp) keeps the tensors on rank 0, which gives each rank its shards (None elsewhere)."""
    state = inputs.state if inputs is not None else None
    start = inputs.start if inputs is not None else None
    small = broadcast_object((Assignment(inputs.model_config, inputs.position, inputs.owned, inputs.slot,
                                         expert_steps(state.optim) if state else {}),
                              state is not None) if inputs is not None else None)
    job, has_state = small
    if sharded:
        return start, (state.optim if state else None) if has_state else {}, job
    return broadcast_tensors(start), broadcast_tensors(state.optim if state else None) if has_state else {}, job


@dataclass
class Trained:
    """What `train` hands to `commit`: the trained tensors and what the steps measured."""

    trainer: Trainer
    position: int
    losses: list[float]
    tokens: int
    counts: Optional[torch.Tensor]
    device: torch.device
    seconds_load: float
    seconds_compute: float
    state_bytes: int
    grad_norms: list[float]
    lb_losses: list[float]
    z_losses: list[float]
    timeline: list[list[float]]
    """[local steps done, seconds of compute] at each progress line: tokens/s within the round."""


def _data_stream(p: Params, nodes: int, data: TokenData, job: Assignment, batch: int) -> BatchStream:
    """The node's batches: slot k < sync.num_nodes reads share k of each epoch; a slot beyond them (a node
    that joined while every share was taken) samples windows at random, seeded by its slot, since the epoch
    split is fixed at sync.num_nodes shares for the whole run."""
    t = p.train
    order = p.data.order if job.slot < nodes else "random_windows"
    return BatchStream(data.train, batch, t.seq_len, t.seed, job.slot, job.position, order=order, num_nodes=nodes)


def train(ctx: RoundContext, r: int, node: int, data: TokenData, start: Optional[dict], optim: Optional[dict],
          job: Assignment, on_step: Optional[Callable[[int], None]] = None, log_progress: bool = True) -> Trained:
    """Every rank: the node's `sync.every_steps` local steps from `start` (global r-1, or with sync.overlap the
    node's own model: spes/round/inputs.py), this rank's share of each batch."""
    t0 = time.perf_counter()
    p, method = ctx.p, ctx.method
    steps = p.sync.every_steps
    rank, ranks = rank_and_size()
    device = resolve_device(p.orchestration.device, node * ranks + rank)
    cfg = model_for_training(job.model_config, p.model)
    if shards_node(p.train.node_parallel):  # built without storage; each rank's shards come from rank 0's tensors
        with torch.device("meta"):
            model = CausalLM(cfg)
        trainer = build_node_trainer(p, model, job.owned, device, job.expert_steps)
        trainer.load_global(start)
    else:
        model = CausalLM(cfg)
        assert start is not None  # unsharded: every rank holds the broadcast start model
        model.load_canonical_state_dict(start)
        trainer = build_node_trainer(p, model.to(device), job.owned, None, job.expert_steps)
    if optim is None or optim:  # None: a sharded node's rank other than 0, whose shards come from rank 0
        trainer.load_optimizer_tensors(optim)
    torch.manual_seed(node_seed(p.train.seed, node, r))
    batch = method.node_batch_size
    stream = _data_stream(p, method.nodes, data, job, batch)
    share = slice(rank * batch // ranks, (rank + 1) * batch // ranks)
    t_load = time.perf_counter() - t0

    losses, norms, aux, timeline, tokens, counts = [], [], [], [], 0, None
    t1 = time.perf_counter()
    first_step = (r - 1) * steps
    every = p.orchestration.log_every_steps if log_progress else 0
    for i in range(steps):
        x, y = stream.next()  # the node's batch; this rank's rows of it
        m = trainer.train_step(x[share], y[share], first_step + i)
        losses.append(m.ce)
        if m.grad_norm is not None:
            norms.append(m.grad_norm)
        if m.lb is not None and m.z is not None:
            aux.append(torch.stack([m.lb, m.z]))
        tokens += m.tokens
        if m.expert_counts_LE is not None:
            counts = m.expert_counts_LE if counts is None else counts + m.expert_counts_LE
        if every and rank == 0 and ((i + 1) % every == 0 or i + 1 == steps):
            elapsed = time.perf_counter() - t1
            _log_progress(node, r, i + 1, steps, float(m.ce), tokens, elapsed)  # a host sync
            timeline.append([i + 1, elapsed])
        if on_step is not None:
            on_step(i)
    losses_cpu: list[float] = torch.stack(losses).tolist()  # the round's one wait for the device
    norms_cpu: list[float] = torch.stack(norms).float().tolist() if norms else []
    aux_cpu: list[list[float]] = torch.stack(aux).tolist() if aux else []
    return Trained(trainer, stream.position, losses_cpu, tokens, counts, device, t_load, time.perf_counter() - t1,
                   trainer.state_bytes(), norms_cpu, [a[0] for a in aux_cpu], [a[1] for a in aux_cpu], timeline)


def commit(ctx: RoundContext, r: int, node: int, inputs: RoundInputs, t: Trained, trained: dict[str, torch.Tensor],
           optim: dict[str, torch.Tensor], checkpoint: bool, bytes_read0: int, bytes_written0: int,
           seconds_read: float = 0.0) -> tuple[NodeReport, Optional[dict[str, torch.Tensor]]]:
    """Rank 0: encode the upload (`trained`: the trainer's upload), keep the node's state (`optim`: its
    optimizer tensors) and checkpoint it, commit the upload. `seconds_read`: what reading the inputs took.
    Returns the report and, with sync.overlap, the node's exact delta of the round (kept in its state)."""
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
    files, residual = encode_upload(ctx.method, codec, inputs.start, trained, owned, residual, p.sync.error_feedback)
    if p.sync.average_optimizer_state:
        files[MOMENTS_FILE] = averaged_moments(ctx.method, optim)
    sent = own_delta(ctx.method, inputs.start, trained, owned) if p.sync.overlap != "none" else None
    saved = local.save_state(r, t.position, optim, residual, files.get(EXPERTS_FILE, {}), owned, sent,
                             (r - 1, inputs.prev_sha))
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
    return node_report(manifest, f"{store.url}/{rel}", time.perf_counter() - t2), sent


def _log_progress(node: int, r: int, done: int, steps: int, loss: float, tokens: int, seconds: float) -> None:
    log.info("%s", Progress(node, r, done, steps, loss, tokens, seconds).line())


def node_round(ctx: RoundContext, r: int, node: int, data: TokenData,
               on_step: Optional[Callable[[int], None]] = None, checkpoint: bool = False,
               from_checkpoint: bool = False, ahead: Optional[Lookahead] = None) -> Optional[NodeReport]:
    """Node `node`'s part of round r: read its inputs, train `sync.every_steps` local steps, commit its upload;
    returns its report.

    On a node of several ranks (torch.distributed initialized) every rank calls this: each trains on its
    share of every batch (data parallel, the model replicated or sharded: train.node_parallel), rank 0
    alone reads and writes storage and returns the report (the others return None).

    `ahead` (sync.overlap, a node of one rank): the node's process trains round r+1 on a thread as soon as
    round r is committed, and round r+1 takes that result when its inputs are the ones assumed
    (spes/round/lookahead.py)."""
    lead = rank_and_size()[0] == 0
    p, store = ctx.p, ctx.store
    done = committed_report(ctx.run, r, node) if lead else None
    if broadcast_object(done is not None):  # a retry after the node already finished
        return done
    read0, written0 = store.bytes_read, store.bytes_written
    t_read = time.perf_counter()
    inputs = read_inputs(ctx, r, node, from_checkpoint) if lead else None
    t_read = time.perf_counter() - t_read
    ahead = ahead if ahead is not None and p.sync.overlap != "none" and rank_and_size()[1] == 1 else None
    t = ahead.take(Assumed.of(ctx.name, ctx.p, r, node, data.folder, inputs)) if ahead is not None and inputs is not None else None
    if t is None:
        start, optim, job = _share(inputs, shards_node(p.train.node_parallel))
        t = train(ctx, r, node, data, start, optim, job, on_step)
    else:
        log.info("node %d round %d: trained while round %d was synchronised", node, r, r - 1)
    trained, optim = t.trainer.upload(), t.trainer.optimizer_tensors()  # every rank: gathers under fsdp
    if inputs is None:  # not rank 0
        return None
    report, sent = commit(ctx, r, node, inputs, t, trained, optim, checkpoint, read0, written0, t_read)
    if ahead is not None and sent is not None and r < p.sync.rounds and report.upload is not None:
        _train_ahead(ctx, r + 1, node, data, inputs, t, sent, optim, report.upload.state.digest, ahead)
    return report


def _train_ahead(ctx: RoundContext, r: int, node: int, data: TokenData, before: RoundInputs, t: Trained,
                 sent: dict[str, torch.Tensor], optim: dict[str, torch.Tensor], digest: str, ahead: Lookahead) -> None:
    """Start round r on a thread from what round r-1 left in memory: global r-2 + the node's delta of round
    r-1 (the start read_inputs builds for round r from the same state), its optimizer state, same experts."""
    owned = t.trainer.owned
    start = with_own_delta(ctx.method, before.prev, sent, owned)
    job = Assignment(before.model_config, t.position, owned, before.slot, expert_steps(optim))
    assumed = Assumed(ctx.name, ctx.p, r, node, data.folder, digest, (r - 2, before.prev_sha), owned, before.slot,
                      t.position, before.model_config, torch.get_num_threads())
    ahead.start(assumed, lambda: train(ctx, r, node, data, start, optim, job, log_progress=False))

