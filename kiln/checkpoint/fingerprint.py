"""What makes two runs the same run: the settings that change the math of training (model,
optimizer, schedule, data, sequence length and its phases, seed, global batch and its ramp). A checkpoint records them, and
resuming under different ones is refused unless forced; the layout, logging and checkpoint
settings, and where an invocation stops (train.stop_at_step, train.time_limit_minutes) may change
freely between restarts. train.max_steps is the horizon of a decaying learning-rate schedule, so it
belongs to the run unless the schedule is flat."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kiln.config import JobConfig
from kiln.config.load import moved_key

DEFINING = (
    "model.",
    "optimizer.",
    "scheduler.",
    "data.",
    # How replica groups synchronize: a group that heals from another must do it alike.
    "fault_tolerance.sync",
    "fault_tolerance.outer_",
    "fault_tolerance.fragment",
    "train.seq_len",  # and train.seq_len_schedule
    "train.batch_schedule",
    "train.seed",
    "train.loss",
    "train.z_loss_weight",
    "train.grad_clip_norm",
)
# train.loss_chunk_tokens only sets how much of the logits the chunked loss holds at once.
NOT_DEFINING = (
    "data.num_workers",
    "data.prefetch_steps",
    "model.preset",
    "train.loss_chunk_tokens",
)
# Losses that compute the same function: a run may switch between them (e.g. to save memory).
SAME_LOSS = {"chunked_cross_entropy": "cross_entropy"}
FLAT_SCHEDULES = ("constant", "none")


def run_fingerprint(cfg: JobConfig, *, global_batch: int) -> dict[str, Any]:
    flat = _flatten(asdict(cfg))
    kept = {
        key: value
        for key, value in flat.items()
        if key.startswith(DEFINING) and key not in NOT_DEFINING
    }
    kept["train.loss"] = SAME_LOSS.get(cfg.train.loss, cfg.train.loss)
    ramp = cfg.train.batch_schedule
    if ramp.tokens:  # the ramp's rounding, resolved: the default follows the layout's micro-batch
        row = global_batch // cfg.train.grad_accum_steps
        kept["train.batch_schedule.multiple_of"] = ramp.multiple_of or row
    if cfg.scheduler.name not in FLAT_SCHEDULES:
        kept["train.max_steps"] = cfg.train.max_steps
    return {**kept, "train.global_batch": global_batch}


def fingerprint_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One `key: saved -> current` line per setting that differs. A setting the saved
    fingerprint lacks was added by a later kiln: the older run did not record it, so it is not
    a change. A run recorded before a key was moved (the flat MoE keys of [model], now
    [model.moe]) is read under the key's current name: the same setting, not a change."""
    saved = {moved_key(key): value for key, value in saved.items()}
    keys = sorted(set(saved))
    return [
        f"{key}: {saved.get(key, '(unset)')!r} -> {current.get(key, '(unset)')!r}"
        for key in keys
        if saved.get(key) != current.get(key)
    ]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat
