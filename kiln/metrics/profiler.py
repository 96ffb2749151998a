"""torch.profiler traces of chosen steps on chosen ranks ([profiling]).

The trace covers steps start_step..end_step and is written when end_step finishes (or the run
stops before it) to <run_dir>/profile/rank_<r>/steps_<a>-<b>.pt.trace.json: Chrome trace JSON,
which Perfetto (ui.perfetto.dev) and chrome://tracing open, and TensorBoard's profiler plugin
reads from that folder. kiln's phases are named in it (`record_function`): data, forward,
backward, pipeline forward-backward, optimizer, checkpoint, all-to-all. With record_memory, a
CUDA run also writes the allocator's history (memory_snapshot.pickle, for
pytorch.org/memory_viz); on a CPU the trace carries the profiler's memory events.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kiln.config import JobConfig
from kiln.log import warn

PROFILE_DIR = "profile"
# Allocation events kept by the CUDA memory history: enough for a few steps of a large model.
MEMORY_HISTORY_ENTRIES = 200_000


class StepProfiler:
    """Starts before `start_step`, writes after `end_step`; does nothing on other ranks."""

    def __init__(self, job: JobConfig, *, rank: int, device: torch.device):
        cfg = job.profiling
        self.cfg, self.active = cfg, cfg.enabled and (not cfg.ranks or rank in cfg.ranks)
        self.folder = Path(job.metrics.run_dir) / PROFILE_DIR / f"rank_{rank}"
        self.cuda = device.type == "cuda"
        self.profiler: profile | None = None
        self.first_step = self.last_step = 0

    def before_step(self, step: int) -> None:
        if not self.active or self.profiler is not None:
            return
        if self.cfg.start_step <= step <= self.cfg.end_step:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            memory = self.cfg.record_memory
            if memory and self.cuda:
                # Python frames only: C++ frames are symbolized with addr2line when the snapshot
                # is taken, which failed on an H200 machine ("RuntimeError: stoi") and is slow.
                torch.cuda.memory._record_memory_history(
                    stacks="python", max_entries=MEMORY_HISTORY_ENTRIES
                )
            self.profiler = profile(
                activities=activities, record_shapes=memory, profile_memory=memory
            )
            self.profiler.start()
            self.first_step = step

    def after_step(self, step: int) -> None:
        if self.profiler is not None:
            self.last_step = step
            if step >= self.cfg.end_step:
                self.close()

    def close(self) -> None:
        """Write what was traced (a run that stops early writes the steps it ran)."""
        if self.profiler is None:
            return
        profiler, self.profiler, self.active = self.profiler, None, False
        profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        first, last = self.first_step, self.last_step
        trace = self.folder / f"steps_{first}-{last}.pt.trace.json"
        profiler.export_chrome_trace(str(trace))
        written = [trace]
        if self.cfg.record_memory and self.cuda:
            snapshot = self.folder / "memory_snapshot.pickle"
            try:
                torch.cuda.memory._dump_snapshot(str(snapshot))
                written.append(snapshot)
            except RuntimeError as error:  # a diagnostic that fails must not end the run
                warn(f"the CUDA memory snapshot could not be written ({error}); the trace was")
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
        warn(f"profile of steps {first}-{last} written: {', '.join(map(str, written))}")
