"""A step watchdog: when one training step runs past its bound, print every thread's stack and
end the process, so a rank stuck in a kernel, a collective or a deadlock cannot hang the job
silently (the other ranks then fail on their next collective). Before it ends the process, it
writes the flight recorder's dump and summary (flight_recorder.py)."""

from __future__ import annotations

import faulthandler
import os
import sys
import threading

from kiln.log import warn
from kiln.resilience import flight_recorder
from kiln.resilience.exit_codes import HUNG

# How long a hung rank spends on its flight-recorder dump before it exits anyway: the dump
# waits up to 5 s for the other ranks' dumps.
DUMP_SECONDS = 15.0


class StepWatchdog:
    def __init__(self, timeout_s: float, *, rank: int):
        self.timeout_s = timeout_s
        self.rank = rank
        self._step: int | None = None
        self._armed = threading.Event()
        self._disarmed = threading.Event()
        self._stop = False
        self._thread = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="kiln-watchdog", daemon=True)
            self._thread.start()

    def arm(self, step: int) -> None:
        """Start timing `step`."""
        if self._thread is None:
            return
        self._step = step
        self._disarmed.clear()
        self._armed.set()

    def disarm(self) -> None:
        if self._thread is None:
            return
        self._armed.clear()
        self._disarmed.set()

    def close(self) -> None:
        if self._thread is None:
            return
        self._stop = True
        self._armed.set()
        self._disarmed.set()
        self._thread.join()
        self._thread = None

    def _watch(self) -> None:
        while True:
            self._armed.wait()
            if self._stop:
                return
            if not self._disarmed.wait(self.timeout_s) and not self._stop:
                self._fire()

    def _fire(self) -> None:
        warn(
            f"rank {self.rank}: step {self._step} has run for more than "
            f"{self.timeout_s:g} s (resilience.step_timeout_s); the stacks of all threads "
            f"follow, then this process exits with code {HUNG}"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        # The summary may name the rank this one waits for, but the exit must happen even if
        # writing it hangs too (a stuck shared filesystem is a common cause of hangs).
        writer = threading.Thread(target=self._dump_flight_record, daemon=True)
        writer.start()
        writer.join(DUMP_SECONDS)
        sys.stderr.flush()
        os._exit(HUNG)

    def _dump_flight_record(self) -> None:
        try:
            flight_recorder.dump(f"step {self._step} ran past resilience.step_timeout_s")
        except Exception as error:
            warn(f"rank {self.rank}: the flight recorder could not be written: {error}")
