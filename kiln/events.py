"""The run's event log, `events.jsonl` in the run directory: one JSON object per line, written by
rank 0, for what happened to the run beside its steps: each checkpoint (when it was committed and
what it cost the loop), each resume, each skipped or rolled-back step, each stop.

`metrics.jsonl` keeps one record per logged step; what reads it (`kiln compare`, the loss plot)
never reads this file. Every subsystem that has something to record gets the log as an argument.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

EVENTS_FILE = "events.jsonl"

Event = Literal[
    "checkpoint",
    "resume",
    "nan_skip",
    "spike_skip",
    "rollback",
    "stop",
    "quorum",
    "not_committed",
    "preflight",
    "export_hf",
]


class EventLog:
    """Appends events to `<run_dir>/events.jsonl`; a no-op where `enabled` is false (ranks > 0)."""

    def __init__(self, run_dir: Path, *, enabled: bool):
        self.path = Path(run_dir) / EVENTS_FILE if enabled else None

    def write(self, event: Event, **fields: Any) -> None:
        """One line: the event's name, the wall-clock time, then `fields`."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"event": event, "time": round(time.time(), 3), **fields}
        # A line per write, flushed on close: a run killed right after still shows it.
        with open(self.path, "a") as file:
            file.write(json.dumps(record, default=str) + "\n")


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every event of the run in `run_dir`, oldest first (none: an empty list)."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
