"""A run's curves as TensorBoard event files, offline: `tensorboard --logdir artifacts/tensorboard` shows every
run of this machine (and every variant of a study) side by side, tokens on the x-axis so runs overlay.

Written by the orchestrator from each round's record, so it needs nothing from the node machines (the
record already carries every node's per-step losses, its expert load and its traffic):

    train/loss/node<i>         each local step's loss of node i (x: the run's training tokens at that step)
    train/grad_norm/node<i>    each local step's gradient norm on node i, before clipping
    train/lb_loss/node<i>      each local step's load-balancing term (before its coefficient), MoE only
    train/z_loss/node<i>       each local step's router z-loss term (before its coefficient), MoE only
    train/tokens_per_s/node<i> node i's training tokens per second of compute in the round
    train/tokens_per_s_within/node<i>   the same between two progress lines (orchestration.log_every_steps)
    train/lr                   the learning rate of each step (the schedule the nodes follow)
    heldout/loss               the committed global's held-out loss (eval.every_rounds)
    traffic/up_bytes/node<i>   bytes node i wrote for the round, traffic/down_bytes/node<i> what it read
    round/wall_s, round/max_node_compute_s, round/heldout_s, sync/merge_alpha
    experts/balance/layer<l>   the busiest expert's share of the routed rows over the mean, over all nodes
    experts/load/layer<l>/expert<e>/node<i>   the rows node i routed to expert e of layer l in the round

One folder per run (<dir>/<run>); a resume from round k drops what the folder held past round k's tokens
(SummaryWriter's purge_step), so a recomputed round replaces its points instead of doubling them.
"""
from __future__ import annotations

import math
import os
from typing import Optional

from spes.config.schema import Params
from spes.model.losses import load_balance
from spes.run.records import RoundRecord
from spes.train.schedule import lr_at


def board_dir(p: Params, run: str) -> Optional[str]:
    """Where the run's events go (orchestration.tensorboard_dir, relative to artifacts_dir), or None (off)."""
    d = p.orchestration.tensorboard_dir
    if d is None:
        return None
    return os.path.join(d if os.path.isabs(d) else os.path.join(p.artifacts_dir, d), run)


class RunBoard:
    """Appends one round at a time; `tokens_before`: the run's training tokens before the first round added."""

    def __init__(self, p: Params, run: str, tokens_before: int):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package; imported when used

        folder = board_dir(p, run)
        assert folder is not None
        self.p, self.tokens = p, tokens_before
        self.writer = SummaryWriter(folder, purge_step=tokens_before + 1 if tokens_before else None)

    def add(self, rec: RoundRecord) -> None:
        w, s = self.writer, self.p.sync
        ok = [n for n in rec.nodes if n.ok and n.upload is not None]
        steps = max((len(n.upload.losses) for n in ok if n.upload), default=0)
        per_step = rec.tokens / steps if steps else 0.0  # all nodes' tokens of one local step
        first = (rec.round - 1) * s.every_steps
        for i in range(steps):
            x = round(self.tokens + per_step * (i + 1))
            w.add_scalar("train/lr", lr_at(first + i, self.p.train.optim, s.total_steps), x)
            for n in ok:
                assert n.upload is not None
                if i < len(n.upload.losses):
                    w.add_scalar(f"train/loss/node{n.node}", n.upload.losses[i], x)
                for tag, values in (("grad_norm", n.upload.grad_norms), ("lb_loss", n.upload.lb_losses),
                                    ("z_loss", n.upload.z_losses)):
                    if i < len(values):
                        w.add_scalar(f"train/{tag}/node{n.node}", values[i], x)
        self.tokens += rec.tokens
        x = self.tokens
        if rec.heldout_loss is not None:
            w.add_scalar("heldout/loss", rec.heldout_loss, x)
        for n in ok:
            assert n.upload is not None
            if n.upload.seconds_compute > 0:
                w.add_scalar(f"train/tokens_per_s/node{n.node}", n.upload.tokens / n.upload.seconds_compute, x)
            for at, rate in _rates_within(n.upload.timeline, n.upload.tokens / max(1, len(n.upload.losses))):
                w.add_scalar(f"train/tokens_per_s_within/node{n.node}", rate, round(x - rec.tokens + per_step * at))
            for layer, row in enumerate(n.upload.expert_load):  # each expert's routed rows this round
                for e, count in enumerate(row):
                    w.add_scalar(f"experts/load/layer{layer}/expert{e:02d}/node{n.node}", count, x)
        for n in rec.nodes:
            w.add_scalar(f"traffic/up_bytes/node{n.node}", n.bytes_up, x)
            w.add_scalar(f"traffic/down_bytes/node{n.node}", n.bytes_down, x)
        w.add_scalar("round/wall_s", rec.wall_s, x)
        w.add_scalar("round/max_node_compute_s", rec.max_node_compute_s, x)
        w.add_scalar("round/heldout_s", rec.heldout_s, x)
        w.add_scalar("sync/merge_alpha", rec.aggregate.merge_alpha, x)
        for layer, value in enumerate(_balance([n.upload.expert_load for n in ok if n.upload and n.upload.expert_load])):
            w.add_scalar(f"experts/balance/layer{layer}", value, x)
        w.flush()

    def close(self) -> None:
        self.writer.close()


def _rates_within(timeline: list[list[float]], tokens_per_step: float) -> list[tuple[float, float]]:
    """(local steps done, tokens per second since the previous progress line) for each progress line."""
    out, prev_step, prev_s = [], 0.0, 0.0
    for step, seconds in timeline:
        if seconds > prev_s and step > prev_step:
            out.append((step, (step - prev_step) * tokens_per_step / (seconds - prev_s)))
        prev_step, prev_s = step, seconds
    return out


def _balance(loads: list[list[list[int]]]) -> list[float]:
    """Per layer, over all nodes' routed rows: the busiest expert's count over the mean count (0 for a layer
    that routed nothing)."""
    if not loads:
        return []
    totals = [[sum(node[layer][e] for node in loads) for e in range(len(loads[0][layer]))]
              for layer in range(len(loads[0]))]
    return [b if math.isfinite(b) else 0.0 for b in load_balance(totals)]
