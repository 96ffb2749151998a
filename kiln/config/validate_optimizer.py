"""Validation of [optimizer]: its choices, the keys each optimizer reads, and their ranges."""

from __future__ import annotations

from dataclasses import fields
from typing import get_args

from kiln.config.sections import JobConfig, MuonAdjustLr, OptimizerName

OPTIMIZERS = get_args(OptimizerName)
MUON_KEYS = ("momentum", "nesterov", "ns_steps", "adjust_lr", "owner_compute")
ADJUST_LR = get_args(MuonAdjustLr)
# The schedules Schedule-Free leaves the learning rate alone with (after scheduler.warmup_steps).
SCHEDULE_FREE_SCHEDULES = ("constant", "none")


def optimizer_problems(cfg: JobConfig) -> list[str]:
    o, p = cfg.optimizer, []
    if o.name not in OPTIMIZERS:
        return p  # reported with the other choices (config/load.py, `choice_problems`)
    adamw_keys = [f.name for f in fields(o.adamw) if getattr(o.adamw, f.name) is not None]
    if o.name != "muon":
        for key in [k for k in MUON_KEYS if getattr(o, k) is not None]:
            p.append(
                f"optimizer.{key} is a Muon setting, but optimizer.name = {o.name!r}: remove it, "
                "or set optimizer.name = 'muon'"
            )
        for key in adamw_keys:
            p.append(
                f"optimizer.adamw.{key} sets the AdamW half of Muon, but optimizer.name = "
                f"{o.name!r}: set optimizer.{key} instead, or optimizer.name = 'muon'"
            )
        if o.name == "schedule_free_adamw" and cfg.scheduler.name not in SCHEDULE_FREE_SCHEDULES:
            p.append(
                f"optimizer.name = 'schedule_free_adamw' replaces the learning-rate schedule, but "
                f"scheduler.name = {cfg.scheduler.name!r}: set scheduler.name = 'constant' "
                "(scheduler.warmup_steps still warms it up), or pick another optimizer"
            )
        if o.name == "schedule_free_adamw" and o.betas and o.betas[0] == 0:
            p.append(
                "optimizer.betas[0] must be > 0 for 'schedule_free_adamw': it interpolates "
                "between the average and the base sequence (0 would lose the average)"
            )
        return p
    if o.momentum is not None and not 0 <= o.momentum < 1:
        p.append(f"optimizer.momentum must be in [0, 1), got {o.momentum}")
    if o.ns_steps is not None and not 1 <= o.ns_steps < 100:
        p.append(
            f"optimizer.ns_steps (Newton-Schulz iterations) must be in [1, 100), got {o.ns_steps}"
        )
    a = o.adamw
    if a.lr is not None and a.lr <= 0:
        p.append(f"optimizer.adamw.lr must be positive, got {a.lr}")
    if a.weight_decay is not None and a.weight_decay < 0:
        p.append(f"optimizer.adamw.weight_decay must be >= 0, got {a.weight_decay}")
    if a.betas is not None and (len(a.betas) != 2 or not all(0 <= b < 1 for b in a.betas)):
        p.append(f"optimizer.adamw.betas must be two numbers in [0, 1), got {a.betas}")
    if a.eps is not None and a.eps <= 0:
        p.append(f"optimizer.adamw.eps must be positive, got {a.eps}")
    return p
