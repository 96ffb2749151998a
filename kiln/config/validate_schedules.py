"""Validation of `[train.batch_schedule]` (the batch ramp) and `[[train.seq_len_schedule]]` (the
sequence-length phases) for a job of `data_ranks` data-parallel ranks."""

from __future__ import annotations

import math
from itertools import pairwise

from kiln.config.pipeline import PP_SCHEDULES, microbatch_problems
from kiln.config.sections import JobConfig
from kiln.config.training_schedule import phase_batch_size


def schedule_problems(cfg: JobConfig, *, data_ranks: int) -> list[str]:
    """Every problem of the two schedules (the layout itself valid)."""
    return _ramp_problems(cfg, data_ranks) + _phase_problems(cfg)


def _ramp_problems(cfg: JobConfig, data_ranks: int) -> list[str]:
    t, ramp = cfg.train, cfg.train.batch_schedule
    if not ramp.tokens and not ramp.sequences:
        return []
    key, p = "train.batch_schedule", []
    if len(ramp.tokens) != len(ramp.sequences) or len(ramp.tokens) < 2:
        return [
            f"{key}: tokens and sequences are the ramp's points, a global batch (sequences) at "
            f"each token count, at least two of them (the first step's batch at tokens = 0, the "
            f"recipe's batch at the end); got {len(ramp.tokens)} token counts and "
            f"{len(ramp.sequences)} batches"
        ]
    if cfg.fault_tolerance.enabled:
        p.append(
            f"{key} with fault_tolerance.enabled: not supported yet (the ramp is planned over "
            f"one job's data ranks, replica groups change them when a group drops out); remove "
            f"{key} or train without replica groups"
        )
    if ramp.tokens[0] != 0 or any(b <= a for a, b in pairwise(ramp.tokens)):
        p.append(
            f"{key}.tokens ({ramp.tokens}) must start at 0 (the first step's batch) and increase"
        )
    if any(b < a for a, b in pairwise(ramp.sequences)):
        p.append(
            f"{key}.sequences ({ramp.sequences}) goes down: the ramp only grows the batch; list "
            f"non-decreasing batches"
        )
    row = t.batch_size * data_ranks
    full = row * t.grad_accum_steps
    if ramp.sequences[-1] != full:
        p.append(
            f"{key}.sequences ends at {ramp.sequences[-1]}, not the recipe's global batch "
            f"train.batch_size × train.grad_accum_steps × data ranks = {t.batch_size} × "
            f"{t.grad_accum_steps} × {data_ranks} = {full}: end the ramp at {full} (the full "
            f"batch is grad_accum_steps micro-batches; the ramp runs fewer)"
        )
    if ramp.multiple_of < 0 or ramp.multiple_of % row:
        p.append(
            f"{key}.multiple_of ({ramp.multiple_of}) must be 0 or a multiple of one micro-batch "
            f"on every data rank, train.batch_size × data ranks = {row}; nearest: "
            f"{_nearest(ramp.multiple_of, row)}"
        )
        return p
    unit = ramp.multiple_of or row
    if any(s <= 0 or s % unit for s in ramp.sequences):
        nearest = [max(unit, round(s / unit) * unit) for s in ramp.sequences]
        p.append(
            f"{key}.sequences ({ramp.sequences}) must each be a positive multiple of {unit} "
            f"(a whole number of micro-batches of {t.batch_size} on each of {data_ranks} data "
            f"ranks, or of {key}.multiple_of): every step's batch is whole micro-batches on "
            f"every data rank; nearest valid ramp: sequences = {nearest}"
        )
    return p


def _phase_problems(cfg: JobConfig) -> list[str]:
    t, p = cfg.train, []
    if not t.seq_len_schedule or t.seq_len <= 0 or t.batch_size <= 0:
        return p
    streamed = cfg.data.streaming or any(e.streaming for e in cfg.data.datasets)
    if streamed:
        p.append(
            "train.seq_len_schedule with a streamed dataset: not supported (a stream is read "
            "in windows of one length); prepare the dataset (`kiln prepare`) or drop the phases"
        )
    until = [phase.until_tokens for phase in t.seq_len_schedule]
    if until[0] <= 0 or any(b <= a for a, b in pairwise(until)):
        p.append(
            f"train.seq_len_schedule's until_tokens ({until}) must be positive and increase: "
            f"each phase runs until its token count, then the next one, then train.seq_len"
        )
    for i, phase in enumerate(t.seq_len_schedule):
        p += _one_phase_problems(cfg, f"train.seq_len_schedule[{i}]", phase)
    return p


def _one_phase_problems(cfg: JobConfig, key: str, phase) -> list[str]:
    t, d = cfg.train, cfg.distributed
    if phase.seq_len <= 0 or phase.seq_len >= t.seq_len or t.seq_len % phase.seq_len:
        divisors = [k for k in range(1, t.seq_len) if t.seq_len % k == 0][-4:]
        return [
            f"{key}.seq_len ({phase.seq_len}) must be shorter than train.seq_len ({t.seq_len}) "
            f"and divide it: train.seq_len is the last and longest phase (the one the memory "
            f"is planned for), and a shorter phase reads each of its sequences as pieces; "
            f"nearest: {divisors}"
        ]
    if phase.batch_size < 0:
        return [f"{key}.batch_size must be >= 0 (0: the recipe's tokens per micro-batch)"]
    if not phase.batch_size and (t.batch_size * t.seq_len) % phase.seq_len:
        return [
            f"{key}: the recipe's {t.batch_size} × {t.seq_len} tokens per micro-batch are not "
            f"a whole number of sequences of {phase.seq_len}; set {key}.batch_size"
        ]
    rows = phase_batch_size(t, phase)
    p = _pipeline_pass_problems(cfg, key, rows)
    if rows * phase.seq_len > t.batch_size * t.seq_len:
        p.append(
            f"{key}: {rows} sequences of {phase.seq_len} tokens per micro-batch are more than "
            f"the recipe's {t.batch_size} × {t.seq_len}, for which memory is planned; lower "
            f"{key}.batch_size to at most {t.batch_size * t.seq_len // phase.seq_len}"
        )
    if d.cp > 1 and phase.seq_len % (2 * d.cp):
        p.append(
            f"{key}.seq_len ({phase.seq_len}) must be divisible by 2 × distributed.cp = "
            f"{2 * d.cp}: context parallel cuts each sequence into 2·cp chunks"
        )
    elif d.tp > 1 and (phase.seq_len // max(1, d.cp)) % d.tp:
        p.append(
            f"{key}.seq_len ({phase.seq_len}) must leave each cp rank a multiple of "
            f"distributed.tp ({d.tp}) tokens for sequence parallel; use a multiple of "
            f"{math.lcm(2 * d.cp, d.cp * d.tp) if d.cp > 1 else d.tp}"
        )
    return p


def _pipeline_pass_problems(cfg: JobConfig, key: str, rows: int) -> list[str]:
    """A phase's micro-batch of `rows` sequences is one pipeline pass: it must split into the
    schedule's micro-batches as the recipe's does (checked by validate.py first)."""
    d = cfg.distributed
    if d.pp <= 1 or d.pp_schedule not in PP_SCHEDULES or d.pp_microbatches < 0:
        return []
    if microbatch_problems(d, cfg.train.batch_size):
        return []  # the recipe's own split is wrong: one message, validate.py's
    return microbatch_problems(d, rows, f"{key}.batch_size")


def _nearest(value: int, unit: int) -> list[int]:
    low = max(unit, value // unit * unit)
    return sorted({low, low + unit})
