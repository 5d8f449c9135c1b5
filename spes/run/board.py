"""A run's curves as TensorBoard event files, offline: `tensorboard --logdir artifacts/tensorboard` shows every
run of this machine (and every variant of a study) side by side.

Written by the orchestrator from each round's record, so it needs nothing from the node machines (the
record already carries every node's per-step losses, its expert load and its traffic). One TensorBoard run
per node and one for the run's global curves, so the nodes' lines overlay on one chart; the x axis is the
global optimizer step (local steps since the run began), the tokens seen their own tag. The groups are named
so the loss charts sort first:

    <run>/node<i>   loss/train             each local step's loss
                    optim/grad_norm        each local step's gradient norm, before clipping
                    routing/lb_loss, routing/z_loss   each local step's load-balancing and router z-loss terms
                                           (before their coefficients), MoE only
                    speed/tokens_per_s     the node's training tokens per second of compute in the round
                    speed/tokens_per_s_within   the same between two progress lines (orchestration.log_every_steps)
                    traffic/up_bytes, traffic/down_bytes   what the node wrote and read for the round
    <run>/global    loss/heldout           the committed global's held-out loss (eval.every_rounds)
                    eval/<name>            the round's other metrics of that global, by name (the record's
                                           `metrics`: heldout_accuracy, heldout_se, ...)
                    optim/lr               the learning rate of each step (the schedule the nodes follow)
                    tokens/train           the run's training tokens after each step (all nodes)
                    round/wall_s, round/max_node_compute_s, round/heldout_s, round/merge_alpha
                    routing/balance_layer<l>   the busiest expert's share of the routed rows over the mean
                    routing/expert_load_layer<l>   an image: each expert's share of the layer's routed rows
                                           (rows) in every round so far (columns), all nodes together

A resume from round k drops what each folder held past round k's last step (SummaryWriter's purge_step), so
a recomputed round replaces its points instead of doubling them; the heat maps are drawn from the records.
"""
from __future__ import annotations

import math
import os
from typing import Any, Optional

from spes.config.schema import Params
from spes.model.losses import load_balance
from spes.run.records import RoundRecord
from spes.train.schedule import lr_at

GLOBAL = "global"
"""The folder (TensorBoard run) of the run's global curves, beside node<i>."""

_STOPS = ((0.0, (68, 1, 84)), (0.5, (59, 82, 139)), (1.0, (33, 145, 140)), (1.5, (94, 201, 98)), (2.0, (253, 231, 37)))
"""A viridis-like colour per share-over-mean: 0 (unused) dark, 1 (balanced) teal, 2 or more (twice the mean)
yellow."""


def board_dir(p: Params, run: str) -> Optional[str]:
    """Where the run's events go (orchestration.tensorboard_dir, relative to artifacts_dir), or None (off)."""
    d = p.orchestration.tensorboard_dir
    if d is None:
        return None
    return os.path.join(d if os.path.isabs(d) else os.path.join(p.artifacts_dir, d), run)


class RunBoard:
    """Appends one round at a time; `earlier`: the run's committed records before the first round added (their
    tokens and expert loads continue)."""

    def __init__(self, p: Params, run: str, earlier: list[RoundRecord]):
        folder = board_dir(p, run)
        assert folder is not None
        self.p, self.folder = p, folder
        self.tokens = sum(rec.tokens for rec in earlier)
        self.loads: list[list[list[int]]] = []  # per round with loads: per layer, each expert's rows (all nodes)
        for rec in earlier:
            self._keep_load(rec)
        resumed_after = earlier[-1].round if earlier else 0
        self.purge_step = resumed_after * p.sync.every_steps + 1 if resumed_after else None
        self.writers: dict[str, Any] = {}

    def _writer(self, name: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package; imported when used

        if name not in self.writers:
            self.writers[name] = SummaryWriter(os.path.join(self.folder, name), purge_step=self.purge_step)
        return self.writers[name]

    def add(self, rec: RoundRecord) -> None:
        s = self.p.sync
        g = self._writer(GLOBAL)
        ok = [n for n in rec.nodes if n.ok and n.upload is not None]
        steps = max((len(n.upload.losses) for n in ok if n.upload), default=0)
        per_step = rec.tokens / steps if steps else 0.0  # all nodes' tokens of one local step
        first = (rec.round - 1) * s.every_steps
        for i in range(steps):
            x = first + i + 1
            g.add_scalar("optim/lr", lr_at(first + i, self.p.train.optim, s.total_steps), x)
            g.add_scalar("tokens/train", round(self.tokens + per_step * (i + 1)), x)
            for n in ok:
                assert n.upload is not None
                w = self._writer(f"node{n.node}")
                for tag, values in (("loss/train", n.upload.losses), ("optim/grad_norm", n.upload.grad_norms),
                                    ("routing/lb_loss", n.upload.lb_losses), ("routing/z_loss", n.upload.z_losses)):
                    if i < len(values):
                        w.add_scalar(tag, values[i], x)
        self.tokens += rec.tokens
        x = rec.round * s.every_steps  # the round's last step
        if rec.heldout_loss is not None:
            g.add_scalar("loss/heldout", rec.heldout_loss, x)
        for name, value in sorted(rec.metrics.items()):
            if value is not None:
                g.add_scalar(f"eval/{name}", value, x)
        for n in ok:
            assert n.upload is not None
            w = self._writer(f"node{n.node}")
            if n.upload.seconds_compute > 0:
                w.add_scalar("speed/tokens_per_s", n.upload.tokens / n.upload.seconds_compute, x)
            for at, rate in _rates_within(n.upload.timeline, n.upload.tokens / max(1, len(n.upload.losses))):
                w.add_scalar("speed/tokens_per_s_within", rate, first + round(at))
        for n in rec.nodes:
            w = self._writer(f"node{n.node}")
            w.add_scalar("traffic/up_bytes", n.bytes_up, x)
            w.add_scalar("traffic/down_bytes", n.bytes_down, x)
        g.add_scalar("round/wall_s", rec.wall_s, x)
        g.add_scalar("round/max_node_compute_s", rec.max_node_compute_s, x)
        g.add_scalar("round/heldout_s", rec.heldout_s, x)
        g.add_scalar("round/merge_alpha", rec.aggregate.merge_alpha, x)
        if self._keep_load(rec):
            for layer, value in enumerate(_balance(self.loads[-1])):
                g.add_scalar(f"routing/balance_layer{layer}", value, x)
            for layer in range(len(self.loads[-1])):
                g.add_image(f"routing/expert_load_layer{layer}", load_heat_map([r[layer] for r in self.loads]), x)
        for w in self.writers.values():
            w.flush()

    def _keep_load(self, rec: RoundRecord) -> bool:
        loads = [n.upload.expert_load for n in rec.nodes if n.ok and n.upload is not None and n.upload.expert_load]
        if not loads:
            return False
        self.loads.append([[sum(node[layer][e] for node in loads) for e in range(len(loads[0][layer]))]
                           for layer in range(len(loads[0]))])
        return True

    def close(self) -> None:
        for w in self.writers.values():
            w.close()


def load_heat_map(rounds: list[list[int]], cell_h: int = 12, width: int = 600):
    """A CHW uint8 image: a row of cells per expert, a column per round, each cell coloured by the expert's
    routed rows over the round's mean per expert (1 = balanced; _STOPS). Columns are `width // rounds` pixels
    wide (at least 1), so a long run stays one picture."""
    import torch

    experts = len(rounds[0])
    share = torch.zeros(experts, len(rounds), dtype=torch.float64)
    for c, counts in enumerate(rounds):
        total = sum(counts)
        if total:
            share[:, c] = torch.tensor(counts, dtype=torch.float64) * experts / total
    rgb = _colour(share)  # 3 x experts x rounds
    cell_w = max(1, width // len(rounds))
    return rgb.repeat_interleave(cell_h, dim=1).repeat_interleave(cell_w, dim=2)


def _colour(values):
    import torch

    v = values.clamp(0.0, _STOPS[-1][0])
    out = torch.zeros(3, *v.shape, dtype=torch.float64)
    for (a, ca), (b, cb) in zip(_STOPS, _STOPS[1:]):
        t = ((v - a) / (b - a)).clamp(0.0, 1.0)
        inside = (v >= a) & (v <= b)
        for ch in range(3):
            out[ch] = torch.where(inside, ca[ch] + t * (cb[ch] - ca[ch]), out[ch])
    return out.round().to(torch.uint8)


def _rates_within(timeline: list[list[float]], tokens_per_step: float) -> list[tuple[float, float]]:
    """(local steps done, tokens per second since the previous progress line) for each progress line."""
    out, prev_step, prev_s = [], 0.0, 0.0
    for step, seconds in timeline:
        if seconds > prev_s and step > prev_step:
            out.append((step, (step - prev_step) * tokens_per_step / (seconds - prev_s)))
        prev_step, prev_s = step, seconds
    return out


def _balance(totals: list[list[int]]) -> list[float]:
    """Per layer, from each expert's routed rows over all nodes: the busiest expert's count over the mean count
    (0 for a layer that routed nothing)."""
    return [b if math.isfinite(b) else 0.0 for b in load_balance(totals)]
