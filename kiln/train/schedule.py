"""Learning-rate schedules as pure functions of the step (or of the tokens read, in steps at the
full batch: `scheduler.unit = "tokens"`), so resuming needs no scheduler state."""

from __future__ import annotations

import math

from kiln.config.sections import JobConfig, SchedulerConfig
from kiln.config.training_schedule import TrainingSchedule


def lr_horizon(cfg: JobConfig, schedule: TrainingSchedule) -> float:
    """The schedule's end: train.max_steps, or under scheduler.unit = "tokens" the tokens the
    run's steps read, in steps at the full batch and sequence length."""
    if cfg.scheduler.unit == "steps":
        return cfg.train.max_steps
    return schedule.total_tokens(cfg.train.max_steps) / schedule.full_step_tokens


def lr_factor(cfg: SchedulerConfig, step: float, max_steps: float) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (1-based; a fraction of
    a step when the schedule runs over tokens) of a schedule `max_steps` long."""
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
