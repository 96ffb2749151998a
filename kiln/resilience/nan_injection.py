"""`resilience.debug_nan_steps`: make the loss of chosen steps NaN on the last rank only, so the
NaN guard's agreement across ranks is exercised (the other ranks must learn it from the last)."""

from __future__ import annotations

import torch


class NanInjection:
    def __init__(self, steps: list[int], *, rank: int, world_size: int):
        self.steps = set(steps) if rank == world_size - 1 else set()
        self.active = False

    def start_step(self, step: int) -> None:
        self.active = step in self.steps
        self.steps.discard(step)

    def apply(self, losses: torch.Tensor) -> torch.Tensor:
        return losses * float("nan") if self.active else losses
