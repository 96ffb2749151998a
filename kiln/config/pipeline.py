"""The pipeline-schedule names and the arithmetic validation needs: stages and micro-batches.

The rest of the stage arithmetic (which layers and ranks each stage gets) is in
`kiln/parallel/pipeline_split.py`, which builds on this.
"""

from __future__ import annotations

from typing import get_args

from kiln.config.sections import (
    DistributedConfig,
    MultiStageSchedule,
    PipelineSchedule,
    SingleStageSchedule,
)

# Schedules that run one stage per rank, and those that run several (virtual stages).
SINGLE_STAGE_SCHEDULES = get_args(SingleStageSchedule)
MULTI_STAGE_SCHEDULES = get_args(MultiStageSchedule)
PP_SCHEDULES = get_args(PipelineSchedule)


def num_stages(dist: DistributedConfig) -> int:
    return dist.pp * dist.pp_virtual_stages


def microbatches(dist: DistributedConfig, batch_size: int) -> int:
    """Micro-batches per pipeline pass (pp_microbatches = 0: one sequence each)."""
    return dist.pp_microbatches or batch_size


def microbatch_problems(
    dist: DistributedConfig, batch: int, key: str = "train.batch_size"
) -> list[str]:
    """Whether a pipeline pass of `batch` sequences per rank (the value of `key`: the recipe's
    batch, or a sequence-length phase's) splits into the schedule's micro-batches."""
    m = microbatches(dist, batch)
    needed = dist.pp if dist.pp_schedule != "gpipe" else 1
    if batch % m:
        divisors = [k for k in range(needed, batch + 1) if batch % k == 0]
        return [
            f"{key} = {batch} (sequences per rank per pipeline pass) must be divisible by "
            f"distributed.pp_microbatches = {m}; use one of {divisors} micro-batches, or a batch "
            f"size that is a multiple of {m}"
        ]
    if m < needed:
        return [
            f"distributed.pp_schedule = '{dist.pp_schedule}' needs at least pp = {needed} "
            f"micro-batches per pass, got {m}; set distributed.pp_microbatches >= {needed} and "
            f"{key} to a multiple of it (pp_microbatches = 0 uses {key})"
        ]
    rounds = max(1, m // dist.pp)
    if dist.pp_schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and m % rounds:
        return [
            f"distributed.pp_schedule = '{dist.pp_schedule}' runs micro-batches in rounds of pp = "
            f"{dist.pp}: {m} micro-batches is not a multiple of {rounds} rounds; use a multiple "
            f"of {dist.pp}"
        ]
    return []
