"""`python -m tests.distributed.held_back_kiln train ARGS`: `kiln train` with one rank held back,
installed from the outside so that no product module knows of it:

- HELD_BACK_DELAY="<rank>:<seconds>": that rank sleeps before its first health-check all-reduce
  (a slow host reaching the start-up check late);
- HELD_BACK_HANG="<rank>:<step>": that rank sleeps for good at the start of that training step
  (a rank that never arrives at the step's first collective)."""

from __future__ import annotations

import os
import sys
import time

from kiln.cli import main
from kiln.resilience import health
from kiln.train.trainer import Trainer


def _held_back(variable: str) -> float | None:
    """The number after "<rank>:" in `variable` when it names this process's rank."""
    rank, _, value = os.environ.get(variable, "").partition(":")
    return float(value) if rank == os.environ["RANK"] else None


def install() -> None:
    delay, hang = _held_back("HELD_BACK_DELAY"), _held_back("HELD_BACK_HANG")
    if delay is not None:
        real, calls = health._timed_all_reduce, []

        def late(*args, **kwargs):
            if not calls:
                time.sleep(delay)
            calls.append(1)
            return real(*args, **kwargs)

        health._timed_all_reduce = late
        print(f"tests: rank held back {delay:g} s before the health check", file=sys.stderr)
    if hang is not None:
        real_step = Trainer.train_step

        def train_step(self, **flags):
            if self.step + 1 == hang:
                time.sleep(3600)  # the watchdog ends the process long before
            return real_step(self, **flags)

        Trainer.train_step = train_step
        print(f"tests: rank hangs in step {hang:g}", file=sys.stderr)


if __name__ == "__main__":
    install()
    sys.exit(main(sys.argv[1:]))
