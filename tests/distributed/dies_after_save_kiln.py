"""`python -m tests.distributed.dies_after_save_kiln train ARGS`: `kiln train` where each rank
waits until its part of every background save is written (rank 0's part ends only once every
rank's is), and rank 1 SIGKILLs itself right after the save of step 3 is written: a save that
every rank finished and no step boundary committed yet, when a peer dies. Installed from the
outside, so that no product module knows about it."""

from __future__ import annotations

import os
import signal
import sys

from kiln.checkpoint import saver
from kiln.cli import main

DIES_AFTER_SAVING = 3


def install() -> None:
    real_save = saver.CheckpointSaver.save

    def save_then_finish_writing(self, step, **state):
        record = real_save(self, step, **state)
        if self.in_flight is not None:
            self.in_flight.future.exception()  # blocks until this rank's part is written
            if step == DIES_AFTER_SAVING and os.environ["RANK"] == "1":
                os.kill(os.getpid(), signal.SIGKILL)
        return record

    saver.CheckpointSaver.save = save_then_finish_writing


if __name__ == "__main__":
    install()
    sys.exit(main(sys.argv[1:]))
