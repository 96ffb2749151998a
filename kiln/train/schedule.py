"""Learning-rate schedules as pure functions of the step, so resuming needs no scheduler state."""

from __future__ import annotations

import math

from kiln.config.sections import SchedulerConfig


def lr_factor(cfg: SchedulerConfig, step: int, max_steps: int) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (1-based)."""
    if cfg.name == "none":
        return 1.0
    if step <= cfg.warmup_steps:
        return step / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    floor = cfg.min_lr_ratio
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.name == "linear":
        return 1 - (1 - floor) * progress
    if cfg.name == "rex":
        remaining = 1 - progress
        return floor + (1 - floor) * remaining / (0.5 + 0.5 * remaining)
    if cfg.name == "wsd":
        decay_start = max_steps - cfg.decay_ratio * max_steps
        if step <= decay_start:
            return 1.0
        return 1 - (1 - floor) * (step - decay_start) / (max_steps - decay_start)
    raise AssertionError(f"unvalidated scheduler {cfg.name!r}")
