"""What a feature adds to the dense training step (kiln/train/step.py): calls before the step,
after each micro-batch's backward, after the update, and the records of a logged step, and the
arguments it gives the model's forward. The step calls its hooks in order; every rank holds the
same hooks, so the collectives they run line up. The features themselves: step_hooks.py."""

from __future__ import annotations

from typing import Any

import torch

from kiln.data.loader import StepBatch


class StepHook:
    """A no-op at every point; a feature overrides the points it needs."""

    # Whether the loss must be kept per sequence (not summed) for `after_backward`.
    needs_row_losses = False

    def start_step(self, *, logged: bool) -> None:
        """First of all: whether the step is logged (its `records` will be asked for)."""

    def before_step(
        self, batch: StepBatch, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Before any forward; `micro_batches` are this rank's, as read (whole sequences)."""

    def forward_kwargs(self) -> dict[str, Any]:
        """Arguments this feature gives the model's forward in the step (after `before_step`)."""
        return {}

    def after_backward(self, index: int, losses: torch.Tensor, labels: torch.Tensor) -> None:
        """After micro-batch `index`'s backward, with its token-loss sums and its labels."""

    def after_update(self, *, skipped: bool) -> None:
        """After the optimizer update, or after the step was skipped (non-finite values)."""

    def records(self) -> dict[str, float]:
        """The metrics this feature adds to a logged step; every rank calls it at once."""
        return {}
