"""What one rank's expert-parallel all-to-alls moved in a step, and the time they took.

Token copies are counted once per training dispatch (the routing's own figure: not again when
activation checkpointing repeats the forward); bytes and time cover every row exchange, forward
and backward, repeated forwards included, plus the small count exchange in the time. Only rows that leave or reach this rank count: a
rank's rows for its own experts stay in memory.

On CUDA the collectives run on their stream and the host does not wait for them, so the time
is taken with CUDA events read at the end of the step; on CPU (gloo) the call returns when the
exchange is done and a host clock is exact.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class AllToAllStats:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.sent_tokens = self.received_tokens = 0
        self.sent_bytes = self.received_bytes = 0
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def timed(self) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            began = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - began

    def count_tokens(self, *, sent: list[int], received: list[int], rank: int) -> None:
        """One dispatch: token copies (rows) per destination and per source ep rank."""
        self.sent_tokens += sum(sent) - sent[rank]
        self.received_tokens += sum(received) - received[rank]

    def count_bytes(
        self, *, sent: list[int], received: list[int], rank: int, row_bytes: int
    ) -> None:
        """One row exchange of `row_bytes`-byte rows."""
        self.sent_bytes += (sum(sent) - sent[rank]) * row_bytes
        self.received_bytes += (sum(received) - received[rank]) * row_bytes

    def seconds(self) -> float:
        """Time spent in the timed exchanges since the last reset (waits on CUDA events)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1e3
            self._events.clear()
        return self._seconds
