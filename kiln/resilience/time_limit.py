"""`train.time_limit_minutes`: end the invocation with a checkpoint before a wall-clock limit (a
SLURM allocation's), counting what the last step and the last checkpoint save took. Like
Megatron's exit-duration-in-mins; the run continues when the same command is run again."""

from __future__ import annotations

import os
import time
from pathlib import Path


class TimeLimit:
    def __init__(self, minutes: float, *, enabled: bool = True, started: float | None = None):
        """The limit counts from `started` (time.monotonic()), by default from when this process
        started, as a scheduler counts; `enabled`: whether this rank decides (rank 0; the caller
        agrees the decision across ranks)."""
        started = process_started() if started is None else started
        self.deadline = started + 60 * minutes if minutes > 0 and enabled else None

    def expiring(self, *, step_seconds: float, save_seconds: float) -> bool:
        """Called before a step: stop after it when it, one more step and a checkpoint could not
        all finish before the limit (the one more step is what may run before the next check)."""
        if self.deadline is None:
            return False
        remaining = self.deadline - time.monotonic()
        return remaining < 2 * step_seconds + save_seconds


def process_started() -> float:
    """time.monotonic() of when this process started: its age from /proc on Linux (imports and
    start-up count against the limit), else now."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic()
    return time.monotonic() - max(age, 0.0)
