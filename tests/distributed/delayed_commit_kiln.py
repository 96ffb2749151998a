"""`python -m tests.distributed.delayed_commit_kiln train ARGS`: `kiln train` with rank 0's
checkpoint commits 3 s late, and every other rank holding on after starting a background save
until its own part is written: the order in which a rank that reads the filesystem on its own
would decide differently from rank 0 (the race that once made ranks disagree on the last saved
step). Installed from the outside, so that no product module knows about it."""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

from kiln.checkpoint import layout, saver
from kiln.cli import main

NOTICE = "test patch: rank 0 commits each checkpoint 3 s late"


def install() -> None:
    real_commit, real_save = layout.commit, saver.CheckpointSaver.save

    def late_commit(root, step, **kwargs):
        time.sleep(3)
        return real_commit(root, step, **kwargs)

    def save_then_finish_writing(self, step, **state):
        record = real_save(self, step, **state)
        if self.in_flight is not None and dist.get_rank() != 0:
            self.in_flight.future.exception()  # blocks until this rank's part is written
        return record

    layout.commit = late_commit
    saver.CheckpointSaver.save = save_then_finish_writing
    print(f"kiln: {NOTICE}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    install()
    sys.exit(main(sys.argv[1:]))
