"""`train.time_limit_minutes`: end the invocation with a checkpoint before a wall-clock limit (a
SLURM allocation's), counting what the last step and the last checkpoint save took. Like
Megatron's exit-duration-in-mins; the run continues when the same command is run again."""

from __future__ import annotations

import time


class TimeLimit:
    def __init__(self, minutes: float, *, started: float, enabled: bool = True):
        """`started`: time.monotonic() at the start of the invocation; `enabled`: whether this
        rank decides (rank 0; the decision is agreed across ranks by the caller)."""
        self.deadline = started + 60 * minutes if minutes > 0 and enabled else None

    def expiring(self, *, step_seconds: float, save_seconds: float) -> bool:
        """Called before a step: stop after it when it, one more step and a checkpoint could not
        all finish before the limit (the one more step is what may run before the next check)."""
        if self.deadline is None:
            return False
        remaining = self.deadline - time.monotonic()
        return remaining < 2 * step_seconds + save_seconds
