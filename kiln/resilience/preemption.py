"""SIGTERM / SIGUSR1 (what SLURM and torchrun send before killing a job) and SIGINT (Ctrl-C)
become a flag that the training loop reads at a step boundary, so the job stops between steps
with a checkpoint instead of dying in the middle of one. A second Ctrl-C aborts at once."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from kiln.resilience.exit_codes import INTERRUPTED, PREEMPTED

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class PreemptionFlag:
    """Installs handlers for SIGNALS in the main thread; `received` names the first signal."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {}
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        # Repeats are the same request: under SLURM a worker often gets the signal twice, once
        # from SLURM itself and once forwarded by torchrun.
        if self.received is None:
            self.received = signal.Signals(signum).name
            if signum == signal.SIGINT:
                # os.write: print() is not safe inside a signal handler.
                os.write(
                    2,
                    b"\nkiln: Ctrl-C: stopping after this step with a checkpoint "
                    b"(Ctrl-C again aborts at once, losing the steps since the last one)\n",
                )
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class Preempted(Exception):
    """Training stopped at a step boundary on request, after writing a checkpoint."""

    def __init__(self, *, signal_name: str, step: int, checkpoint: Path | None):
        interrupted = signal_name == "SIGINT"
        self.exit_code = INTERRUPTED if interrupted else PREEMPTED
        why = "interrupted" if interrupted else "preempted"
        super().__init__(
            f"stopped by {signal_name} after step {step}; checkpoint {checkpoint}. Exiting with "
            f"code {self.exit_code} ({why}): run the same command again to resume from step {step}"
        )
