"""Local training on one node: shared parameters + the node's own experts are trainable, the rest frozen.

The optimizer is built over trainable parameters only, so frozen experts have no gradient and no
optimizer state (the memory saving SPES relies on). The LR schedule is a pure function of the global
step, so resuming needs only the step, the optimizer tensors and the data position.
The trainer computes on the model's device; what it hands out for storage (upload, optimizer tensors)
is on the CPU. Step metrics stay on the device (0-dim tensors) so a step never waits for the GPU.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Optional, cast

import torch

from spes.config.schema import OptimConfig, Params
from spes.errors import ConfigError, OptimizerStateError
from spes.model.losses import decayed_lb_factor
from spes.model.moe import ExpertChunk, MoE
from spes.model.transformer import CausalLM, ModelOutput
from spes.sync.deltas import MOMENT_KINDS
from spes.train.devices import AUTOCAST_DTYPES, autocast
from spes.train.distributed import broadcast_object, node_mean, node_totals, rank_and_size, shards_node
from spes.train.expert_state import canonical_of_chunk, chunk_state, parse_ranged, ranged_name
from spes.train.schedule import lr_at


@dataclass
class StepMetrics:
    """What a step reports; `ce` is a 0-dim tensor on the model's device (float() on it waits for the step)."""
    ce: torch.Tensor
    tokens: int
    expert_counts_LE: Optional[torch.Tensor]
    grad_norm: Optional[torch.Tensor] = None
    """The L2 norm of the node's gradients of what it trains before clipping (0-dim, on the device)."""
    lb: Optional[torch.Tensor] = None
    """The load-balancing term of the step (before its coefficient; 0-dim, on the device; None: dense)."""
    z: Optional[torch.Tensor] = None
    """The router z-loss term of the step (before its coefficient; 0-dim, on the device; None: dense)."""


class Trainer:
    """One node's optimizer steps. With torch.distributed initialized (a node of several ranks) each rank
    takes its share of the step's batch and gradients are averaged once per step (not per micro-batch):
    `parallel='ddp'` wraps the model in DistributedDataParallel (every rank keeps the same replica and Adam
    state; frozen experts are outside DDP's reduction), `parallel='fsdp'` shards weights, gradients and Adam
    state over the ranks (spes/train/sharding.py). A model on the meta device (fsdp) gets its storage on
    `device` here and its values from `load_global`.

    What goes to storage (`upload`, `optimizer_tensors`) is full CPU tensors on rank 0 and empty on the other
    ranks; under fsdp every rank must call them (they gather the shards)."""

    def __init__(self, model: CausalLM, owned: Iterable[int], optim: OptimConfig, total_steps: int,
                 frozen_dtype: torch.dtype = torch.float32, decayed_lb: bool = False,
                 autocast_dtype: Optional[str] = None, micro_batch_size: Optional[int] = None,
                 parallel: str = "ddp", device: Optional[torch.device] = None,
                 expert_steps: Optional[dict[int, float]] = None):
        self.model, self.cfg, self.total_steps = model, optim, total_steps
        self.autocast_dtype = autocast_dtype
        self.micro_batch_size = micro_batch_size
        self.owned = tuple(sorted(owned))
        self.decayed_lb = decayed_lb
        self.rank, self.ranks = rank_and_size()
        self.lead = self.rank == 0
        if model.cfg.is_moe:
            # experts with different Adam step counts (some taken over from another node) in different chunks
            model.set_trainable_experts(self.owned, frozen_dtype, expert_steps)
        self.fsdp = shards_node(parallel)
        self.ddp = None
        if self.fsdp:
            from spes.train.sharding import shard_model

            shard_model(model, AUTOCAST_DTYPES.get(autocast_dtype))
            if next(model.parameters()).is_meta:
                model.to_empty(device=device)
            self.device = next(model.parameters()).to_local().device
        else:
            self.ddp = _wrap_ddp(model) if self.ranks > 1 else None
            self.device = next(model.parameters()).device
        decay, no_decay = [], []
        for _, p in self.trainable_named_parameters():
            (decay if p.ndim >= 2 or optim.decay_norms else no_decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=1e-8)

    def release(self) -> None:
        """Let go of the weights, gradients and Adam state once the round's results are copied out
        (`upload`, `optimizer_tensors`): with sync.overlap the next round builds its model while this round
        is still being sent, and a device holds one trainer's memory, not two."""
        self.optimizer.state.clear()
        self.model.to("meta")

    def state_bytes(self) -> int:
        """Bytes this rank holds now of weights (trainable and frozen, in their dtypes), gradients and Adam
        moments: after a step, the memory the planner calls weights + gradients + Adam (activations aside)."""
        def nbytes(t) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor shard under fsdp
            return t.numel() * t.element_size()

        total = sum(nbytes(p) + (nbytes(p.grad) if p.grad is not None else 0) for p in self.model.parameters())
        return total + sum(nbytes(st[k]) for st in self.optimizer.state.values() for k in MOMENT_KINDS if k in st)

    def trainable_named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def _lb_expert_weight(self, step: int) -> Optional[torch.Tensor]:
        if not (self.decayed_lb and self.model.cfg.is_moe):
            return None
        w = torch.ones(self.model.cfg.num_experts, device=self.device)
        w[list(self.owned)] = decayed_lb_factor(step, self.total_steps)
        return w

    def train_step(self, input_ids_BS: torch.Tensor, labels_BS: torch.Tensor, step: int) -> StepMetrics:
        """One optimizer step on the node's batch (on several ranks: this rank's share of it), in
        micro-batches of `micro_batch_size` sequences with gradients accumulated."""
        self.model.train()
        for g in self.optimizer.param_groups:
            g["lr"] = lr_at(step, self.cfg, self.total_steps)
        B = input_ids_BS.shape[0]
        mb = self.micro_batch_size or B
        if B % mb:
            raise ConfigError(f"a batch of {B} sequences does not split into micro-batches of {mb}")
        k = B // mb
        lb_weight = self._lb_expert_weight(step)
        self.optimizer.zero_grad(set_to_none=True)
        ce, counts, aux = None, None, None
        for i in range(k):
            x = input_ids_BS[i * mb:(i + 1) * mb].to(self.device, non_blocking=True)
            y = labels_BS[i * mb:(i + 1) * mb].to(self.device, non_blocking=True)
            last = i == k - 1
            with self._no_sync(not last), autocast(self.device, self.autocast_dtype):
                out: ModelOutput = (self.ddp or self.model)(x, y, lb_weight)
            with self._no_sync(not last):
                (out.loss / k).backward()  # the step's loss is the mean over its micro-batches
            ce = out.ce.detach() / k if ce is None else ce + out.ce.detach() / k
            if out.lb is not None and out.z is not None:  # watched, not trained on: detached, as ce
                terms = torch.stack([out.lb.detach(), out.z.detach()]).float() / k
                aux = terms if aux is None else aux + terms
            if out.expert_counts_LE is not None:
                counts = out.expert_counts_LE if counts is None else counts + out.expert_counts_LE
        params = [p for _, p in self.trainable_named_parameters()]
        if self.cfg.grad_clip > 0:  # the norm before clipping, as the clip computes it
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if hasattr(norm, "full_tensor"):  # fsdp: a DTensor of the whole node's norm
            norm = norm.full_tensor()
        self.optimizer.step()
        tokens = B * input_ids_BS.shape[1]
        if self.ranks > 1:  # report the node's step: mean loss, all ranks' tokens and expert loads
            ce, counts, tokens = node_totals(ce, counts, tokens)
            aux = node_mean(aux)
        lb, z = (aux[0], aux[1]) if aux is not None else (None, None)
        return StepMetrics(ce, tokens, counts, norm.detach(), lb, z)

    def _no_sync(self, skip: bool):
        """Gradients are reduced over the ranks in the last micro-batch's backward only."""
        if self.fsdp:
            self.model.set_requires_gradient_sync(not skip)
        return self.ddp.no_sync() if self.ddp is not None and skip else contextlib.nullcontext()

    # -- the global model a round starts from ------------------------------------------------------
    def load_global(self, sd: Optional[dict[str, torch.Tensor]]) -> None:
        """The model's values from canonical tensors (rank 0's; under fsdp the others pass None)."""
        if self.fsdp:
            from spes.train.sharding import load_canonical_sharded

            load_canonical_sharded(self.model, sd, self.lead)
        else:
            self.model.load_canonical_state_dict(sd)

    def _full(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """A CPU copy of the whole tensor on rank 0 (gathered from the shards under fsdp), None elsewhere."""
        if self.fsdp:
            from spes.train.sharding import gather

            return gather(t, self.lead)
        return t.detach().to("cpu", copy=True) if self.lead else None

    # -- what goes up at a sync: shared params + owned expert rows (canonical names) ----------------
    @torch.no_grad()
    def upload(self) -> dict[str, torch.Tensor]:
        up: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            if ".mlp.experts.chunks." not in name:
                up[name] = self._full(p)
        for i, layer in enumerate(self.model.model.layers):
            if isinstance(layer.mlp, MoE):
                trained = [c for c in layer.mlp.experts.chunks if c.trainable]
                for attr in ("gate_up_proj", "down_proj"):
                    rows = [self._full(getattr(c, attr)) for c in trained]
                    if self.lead:
                        up[f"model.layers.{i}.mlp.experts.{attr}"] = torch.cat(rows) if rows else torch.empty(0)
        return up if self.lead else {}

    # -- optimizer state as flat tensors (safetensors-friendly, no pickle) ---------------------------
    def _stored_name(self, name: str) -> str:
        """A trainable parameter's name in the stored state: expert chunks by the experts they hold
        (spes/train/expert_state.py), so the state outlives a change of the chunks."""
        canonical = canonical_of_chunk(name)
        if canonical is None:
            return name
        chunk = cast(ExpertChunk, self.model.get_submodule(name.rsplit(".", 1)[0]))
        return ranged_name(canonical, chunk.start, chunk.end)

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, p in self.trainable_named_parameters():
            st = self.optimizer.state.get(p)
            if not st:
                continue
            key = self._stored_name(name)
            out[f"{key}::exp_avg"] = self._full(st["exp_avg"])
            out[f"{key}::exp_avg_sq"] = self._full(st["exp_avg_sq"])
            out[f"{key}::step"] = torch.as_tensor(st["step"], dtype=torch.float64).cpu().reshape(1).clone()
        return out if self.lead else {}

    def _states_by_param(self, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """Trainable parameter name -> its stored {'step', 'exp_avg', 'exp_avg_sq'} (absent: starts fresh).
        The shared parameters' must match exactly; experts given away are dropped, experts taken over are
        absent."""
        names = [n for n, _ in self.trainable_named_parameters()]
        shared = {n for n in names if canonical_of_chunk(n) is None}
        stored = {k.split("::")[0] for k in tensors}
        legacy = {k for k in stored if canonical_of_chunk(k) is not None}  # names before ranged expert state
        plain = {k for k in stored if parse_ranged(k) is None} - legacy
        if (plain and plain != shared) or (legacy and legacy != set(names) - shared):
            have = plain | legacy
            want = shared | (set(names) - shared if legacy else set())
            raise OptimizerStateError(f"optimizer state does not match this node's trainable parameters: "
                             f"extra {sorted(have - want)[:3]}, missing {sorted(want - have)[:3]}")
        out = {}
        for n in names:
            if n in stored:
                out[n] = {"step": tensors[f"{n}::step"], **{k: tensors[f"{n}::{k}"] for k in MOMENT_KINDS}}
            elif n not in shared:
                canonical, chunk = canonical_of_chunk(n), cast(ExpertChunk, self.model.get_submodule(n.rsplit(".", 1)[0]))
                st = chunk_state(tensors, canonical, chunk.start, chunk.end)
                if st is not None:
                    out[n] = st
        return out

    def load_optimizer_tensors(self, tensors: Optional[dict[str, torch.Tensor]]) -> None:
        """Adam's state from `optimizer_tensors`' format (rank 0's; under fsdp the others pass None and get
        their shards). Experts this node did not train before start with a fresh state."""
        states = None if tensors is None else self._states_by_param(tensors)
        steps = None if states is None else {n: float(st["step"].reshape(-1)[0].item()) for n, st in states.items()}
        if self.fsdp:
            from spes.train.sharding import scatter

            steps = broadcast_object(steps)
        for name, p in self.trainable_named_parameters():
            if name not in steps:
                continue
            if self.fsdp:
                moments = {k: scatter(states[name][k] if self.lead else None, p) for k in MOMENT_KINDS}
            else:
                moments = {k: states[name][k].to(device=p.device, dtype=p.dtype, copy=True) for k in MOMENT_KINDS}
            self.optimizer.state[p] = {"step": torch.tensor(steps[name]), **moments}


def _wrap_ddp(model: CausalLM):
    from torch.nn.parallel import DistributedDataParallel

    dev = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                   broadcast_buffers=False)


FROZEN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_node_trainer(p: Params, model: CausalLM, owned: tuple[int, ...], device: Optional[torch.device] = None,
                       expert_steps: Optional[dict[int, float]] = None) -> Trainer:
    """A node's trainer under the run's settings: its `owned` experts (the round's membership; before round 1
    spes/train/planned_nodes.py) trainable, the others frozen in `train.frozen_dtype`; its ranks (if several)
    working as `train.node_parallel` says. `device`: where a model on the meta device goes; `expert_steps`:
    the stored Adam step count of each expert (chunks by count)."""
    t = p.train
    model.activation_checkpointing = t.activation_checkpointing == "block"
    if t.compile:
        for block in model.model.layers:
            block.compile()
    return Trainer(model, owned, t.optim, p.sync.total_steps, FROZEN_DTYPES[t.frozen_dtype], t.decayed_lb, t.autocast,
                   t.micro_batch_size, t.node_parallel, device, expert_steps)
