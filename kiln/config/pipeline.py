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
