"""The inner learning-rate schedule: a pure function of the global step, so a resume needs only the step.

cosine: linear warm-up to lr, then cosine decay to lr * min_lr_ratio at total_steps. wsd (warmup-stable-
decay): lr until the last decay_fraction of the steps, then linear decay to the floor.
"""
from __future__ import annotations

import math

from spes.config.schema import OptimConfig


def stable_end(cfg: OptimConfig, total_steps: int) -> int:
    """wsd: the first step of the decay (steps before it run at cfg.lr once warmed up)."""
    return max(cfg.warmup_steps, total_steps - math.ceil(cfg.decay_fraction * total_steps))


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warm-up to cfg.lr, then (cosine) cosine decay to cfg.lr * min_lr_ratio at total_steps, or (wsd)
    cfg.lr until stable_end, then linear decay to cfg.lr * min_lr_ratio at total_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "wsd":
        start = stable_end(cfg, total_steps)
        if step < start:
            return cfg.lr
        return cfg.lr + (floor - cfg.lr) * min(1.0, (step - start) / max(1, total_steps - start))
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
