"""A node's local steps of one round (every rank): the model built from the round's start, the node's
optimizer state loaded, `sync.every_steps` steps on its share of the data; what they measured.
spes/round/node.py reads the inputs before and commits the upload after."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from spes.config.schema import Params, model_for_training
from spes.data.tokens import BatchStream, TokenData
from spes.model.transformer import CausalLM
from spes.round.context import RoundContext
from spes.round.inputs import RoundInputs
from spes.round.progress_line import Progress
from spes.train.devices import resolve_device
from spes.train.distributed import broadcast_object, broadcast_tensors, rank_and_size, shards_node
from spes.train.expert_state import expert_steps
from spes.train.trainer import Trainer, build_node_trainer

log = logging.getLogger("spes.round.node")  # the progress lines' logger name, which parse_progress reads


def node_seed(seed: int, node: int, r: int) -> int:
    """Torch RNG seed of node `node` in round r: distinct per (run seed, node, round), so any use of
    randomness in a step (dropout, noise) replays exactly on a retry or resume. Spaced by primes."""
    return seed * 100003 + node * 1009 + r


@dataclass(frozen=True)
class LocalRound:
    """Whose local steps: node `node`'s round r of the run in `ctx`, on its token data."""

    ctx: RoundContext
    r: int
    node: int
    data: TokenData


@dataclass
class Assignment:
    """What every rank of the node needs to know about its round besides tensors."""

    model_config: dict
    position: int
    owned: tuple[int, ...]
    slot: int
    expert_steps: dict[int, float]


@dataclass
class Start:
    """What the local steps start from on a rank: the model, the optimizer tensors ({}: none yet; None: a
    sharded node's rank other than 0, whose shards come from rank 0) and the round's assignment."""

    model: Optional[dict]
    optim: Optional[dict]
    assignment: Assignment


def share_inputs(inputs: Optional[RoundInputs], sharded: bool) -> Start:
    """The round's start on every rank of the node. A sharded node (fsdp) keeps the tensors on rank 0, which
    gives each rank its shards (None elsewhere)."""
    state = inputs.state if inputs is not None else None
    start = inputs.start if inputs is not None else None
    small = broadcast_object((Assignment(inputs.model_config, inputs.position, inputs.owned, inputs.slot,
                                         expert_steps(state.optim) if state else {}),
                              state is not None) if inputs is not None else None)
    assignment, has_state = small
    if sharded:
        return Start(start, (state.optim if state else None) if has_state else {}, assignment)
    return Start(broadcast_tensors(start), broadcast_tensors(state.optim if state else None) if has_state else {},
                 assignment)


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


def _trainer(p: Params, begin: Start, device: torch.device) -> Trainer:
    """This rank's trainer: the model built from the round's start, the node's optimizer state loaded."""
    start, optim, job = begin.model, begin.optim, begin.assignment
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
    return trainer


def train(local: LocalRound, begin: Start, on_step: Optional[Callable[[int], None]] = None,
          log_progress: bool = True) -> Trained:
    """Every rank: the node's `sync.every_steps` local steps from `begin` (global r-1, or with sync.overlap the
    node's own model: spes/round/inputs.py), this rank's share of each batch."""
    t0 = time.perf_counter()
    ctx, r, node, data = local.ctx, local.r, local.node, local.data
    job, p, method = begin.assignment, ctx.p, ctx.method
    steps = p.sync.every_steps
    rank, ranks = rank_and_size()
    device = resolve_device(p.orchestration.device, node * ranks + rank)
    trainer = _trainer(p, begin, device)
    torch.manual_seed(node_seed(p.train.seed, node, r))
    batch = method.node_batch_size
    stream = _data_stream(p, method.nodes, data, job, batch)
    share = slice(rank * batch // ranks, (rank + 1) * batch // ranks)
    t_load = time.perf_counter() - t0

    losses, norms, aux, timeline, tokens, counts = [], [], [], [], 0, None
    t1 = time.perf_counter()
    first_step = (r - 1) * steps
    every = p.orchestration.log_every_steps  # a round trained ahead keeps its timeline, but logs nothing
    hooks = method.node_hooks(r, node)
    for i in range(steps):
        x, y = stream.next()  # the node's batch; this rank's rows of it
        m = trainer.train_step(x[share], y[share], first_step + i)
        for hook in hooks:
            if hook.wants(i):
                with torch.no_grad():
                    hook(i, dict(trainer.trainable_named_parameters()))
        losses.append(m.ce)
        if m.grad_norm is not None:
            norms.append(m.grad_norm)
        if m.lb is not None and m.z is not None:
            aux.append(torch.stack([m.lb, m.z]))
        tokens += m.tokens
        if m.expert_counts_LE is not None:
            counts = m.expert_counts_LE if counts is None else counts + m.expert_counts_LE
        if every and rank == 0 and ((i + 1) % every == 0 or i + 1 == steps):
            loss = float(m.ce)  # a host sync: the seconds below are the device's
            elapsed = time.perf_counter() - t1
            if log_progress:  # not while another round is in the log: its lines would read as that round's
                log.info("%s", Progress(node, r, i + 1, steps, loss, tokens, elapsed).line())
            timeline.append([i + 1, elapsed])
        if on_step is not None:
            on_step(i)
    losses_cpu: list[float] = torch.stack(losses).tolist()  # the round's one wait for the device
    norms_cpu: list[float] = torch.stack(norms).float().tolist() if norms else []
    aux_cpu: list[list[float]] = torch.stack(aux).tolist() if aux else []
    return Trained(trainer, stream.position, losses_cpu, tokens, counts, device, t_load, time.perf_counter() - t1,
                   trainer.state_bytes(), norms_cpu, [a[0] for a in aux_cpu], [a[1] for a in aux_cpu], timeline)
