"""Data-loader worker processes and the signals that stop a job."""

from __future__ import annotations

import os
import signal


def detach_loader_worker(worker_id: int = 0) -> None:
    """torchrun signals the whole process group of a rank, SLURM every process of the job, and a
    terminal's Ctrl-C the foreground process group; but the training process decides when to stop
    and shuts its workers down itself: a worker killed first would fail the step that writes the
    checkpoint. So a worker leaves the rank's process group and ignores SIGUSR1; SIGTERM stays
    deadly, as the DataLoader needs it to stop a stuck worker."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
