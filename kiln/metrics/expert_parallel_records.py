"""What expert parallel moved in a logged step, per rank of the ep group (rank 0's group):

- `ep/sent_tokens`, `ep/received_tokens`: token copies (a token once per expert it is routed
  to) that this rank's dispatches sent to / received from other ep ranks, counted from the
  routing once per training forward (not again when activation checkpointing repeats it);
- `ep/sent_bytes`, `ep/received_bytes`: what the row exchanges moved off / onto the rank:
  dispatch and combine, forward and backward, and the forwards activation checkpointing repeats;
- `ep/all_to_all_ms` and `ep/all_to_all_share`: the time inside the exchanges (count exchanges
  included) and its share of the step's wall time. On CPU the exchanges are synchronous; time in
  them includes waiting for the slowest rank of the group, which is what the step loses.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from kiln.parallel.all_to_all_stats import AllToAllStats

FIELDS = ("sent_tokens", "received_tokens", "sent_bytes", "received_bytes")


class ExpertParallelStep:
    """Resets the rank's all-to-all figures at the start of a training step and keeps them, with
    the step's wall time, at its end (evaluation between steps is not counted)."""

    def __init__(self, stats: AllToAllStats, group: dist.ProcessGroup):
        self.stats, self.group = stats, group
        self.began = 0.0
        self.last: torch.Tensor | None = None

    def start(self) -> None:
        self.stats.reset()
        self.began = time.perf_counter()

    def end(self) -> None:
        step_seconds = time.perf_counter() - self.began
        values = [float(getattr(self.stats, name)) for name in FIELDS]
        self.last = torch.tensor([*values, self.stats.seconds(), step_seconds], dtype=torch.float64)

    def records(self) -> dict[str, list[float]]:
        """The last step's figures of every ep rank; every rank calls it at once."""
        if self.last is None:
            return {}
        gathered = [torch.zeros_like(self.last) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(gathered, self.last, group=self.group)
        columns = torch.stack(gathered).t().tolist()
        *counts, seconds, step_seconds = columns
        records = {
            f"ep/{name}": [int(v) for v in column]
            for name, column in zip(FIELDS, counts, strict=True)
        }
        records["ep/all_to_all_ms"] = [round(s * 1e3, 3) for s in seconds]
        records["ep/all_to_all_share"] = [
            round(s / t, 4) if t > 0 else 0.0 for s, t in zip(seconds, step_seconds, strict=True)
        ]
        return records
