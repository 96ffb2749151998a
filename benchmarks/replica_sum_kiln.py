"""`kiln train` of one replica group for benchmarks/fault_tolerance.py's (d): times, per step,
the wait after the backward on the cross-group sums, and writes the timings to
<run_dir>/replica_sum_rank_<r>.json at the end (the group's run dir).

`--bench-after-backward` (first argument after `train`, taken out before kiln reads the rest):
the "before" arm of issue 51's item 1. `ReplicaGroups.sum_in_backward` is made to answer
False, so every gradient shard is summed after the backward by `ReplicaGroups.sum_gradients`
in buckets, as before the item. Without it, kiln runs as shipped: each FSDP unit's shard
crosses the groups from FSDP2's all-reduce hook during the backward, and only the loss and the
stop flags are summed after it (`ReplicaGroups.sum([total, stops])`).

Per step (one `TrainStep` call) the file holds, in seconds: `step` (the whole call),
`forward_backward` (every `ForwardBackward` call of the step: the forward and the backward,
with the hook's cross-group sums where they run), `in_backward` (the cross-group all-reduces
issued and waited on inside the forward/backward) and `after_backward` (the cross-group sum
after the backward: `sum_gradients` with the loss and flags, or the loss-and-flags `sum`).
On a GPU the host runs ahead of the streams, so the forward/backward and the sum after it end
with a device synchronize (the backward's all-reduces on FSDP's stream, the root unit's last,
are then inside `forward_backward`), and `in_backward` is only the host's time issuing them.

    python -m benchmarks.replica_sum_kiln train [--bench-after-backward] RECIPE [OVERRIDES]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torchft

import kiln.train.trainer as trainer_module
from kiln.config import load_config
from kiln.parallel.forward_backward import ForwardBackward
from kiln.parallel.replica_groups import ReplicaGroups
from kiln.train.step import TrainStep

AFTER_BACKWARD = "--bench-after-backward"


class Timings:
    """The current step's timings, and every finished step's."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] | None = None
        self.in_forward_backward = False
        self.in_sum_gradients = False

    def add(self, key: str, seconds: float) -> None:
        if self.current is not None:
            self.current[key] += seconds


def main() -> None:
    assert sys.argv[1] == "train", sys.argv
    args = sys.argv[2:]
    after_backward = args[0] == AFTER_BACKWARD and bool(args.pop(0))
    if after_backward:
        ReplicaGroups.sum_in_backward = lambda self, model_parts: False
    timings = timed(Timings())
    run_dir = train(args)
    rank = int(os.environ.get("RANK", "0"))
    out = {"arm": "after_backward" if after_backward else "in_backward", "steps": timings.steps}
    (run_dir / f"replica_sum_rank_{rank}.json").write_text(json.dumps(out))


def train(args: list[str]) -> Path:
    """`kiln train RECIPE [OVERRIDES]` in this process; returns the run dir it wrote (under
    fault tolerance, the group's)."""
    recipe, *overrides = args
    cfg = load_config(recipe, overrides, launched=int(os.environ.get("WORLD_SIZE", "1")))
    trainer = trainer_module.Trainer(cfg)
    trainer.train()
    return Path(trainer.cfg.metrics.run_dir)


def timed(timings: Timings) -> Timings:
    """Wrap the step, its forward/backward and the cross-group sums with a monotonic clock."""
    step_call, fb_call = TrainStep.__call__, ForwardBackward.__call__
    group_sum, sum_gradients = ReplicaGroups.sum, ReplicaGroups.sum_gradients
    allreduce = torchft.Manager.allreduce

    def step(self, *args, **kwargs):
        timings.current = dict.fromkeys(("forward_backward", "in_backward", "after_backward"), 0.0)
        start = time.monotonic()
        result = step_call(self, *args, **kwargs)
        timings.current["step"] = time.monotonic() - start
        timings.current["committed"] = result.committed
        timings.steps.append(timings.current)
        timings.current = None
        return result

    def forward_backward(self, *args, **kwargs):
        timings.in_forward_backward = True
        start = time.monotonic()
        try:
            return fb_call(self, *args, **kwargs)
        finally:
            _synchronize()
            timings.add("forward_backward", time.monotonic() - start)
            timings.in_forward_backward = False

    def managed_allreduce(self, *args, **kwargs):
        # The hook issues the all-reduce and waits on it at once: time both.
        start = time.monotonic()
        work = allreduce(self, *args, **kwargs)
        if not timings.in_forward_backward:
            return work
        return _TimedWork(work, start, timings)

    def summed(self, tensors):
        # The step's first sum, of one tensor, is the valid-token count before the forward;
        # inside sum_gradients, a bucket (timed there as a whole).
        start = time.monotonic()
        group_sum(self, tensors)
        _synchronize()
        if len(tensors) == 2 and not timings.in_sum_gradients:
            timings.add("after_backward", time.monotonic() - start)

    def summed_gradients(self, params, extra):
        timings.in_sum_gradients = True
        start = time.monotonic()
        try:
            sum_gradients(self, params, extra)
        finally:
            _synchronize()
            timings.add("after_backward", time.monotonic() - start)
            timings.in_sum_gradients = False

    TrainStep.__call__ = step
    ForwardBackward.__call__ = forward_backward
    torchft.Manager.allreduce = managed_allreduce
    ReplicaGroups.sum, ReplicaGroups.sum_gradients = summed, summed_gradients
    return timings


def _synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _TimedWork:
    """torchft's work of an all-reduce issued in the backward: its wait ends the timing."""

    def __init__(self, work, start: float, timings: Timings):
        self.work, self.start, self.timings = work, start, timings

    def wait(self, *args, **kwargs):
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            self.timings.add("in_backward", time.monotonic() - self.start)

    def __getattr__(self, name):
        return getattr(self.work, name)


if __name__ == "__main__":
    main()
