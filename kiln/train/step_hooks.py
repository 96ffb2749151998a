"""What a feature adds to the dense training step (kiln/train/step.py): calls before the step,
after each micro-batch's backward, after the update, and the records of a logged step, and the
arguments it gives the model's forward. The step calls its hooks in order; every rank holds the same hooks, so the
collectives they run line up."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kiln.data.loader import StepBatch
from kiln.metrics.expert_parallel_records import ExpertParallelStep
from kiln.train.dataset_losses import DatasetLosses


class StepHook:
    """A no-op at every point; a feature overrides the points it needs."""

    # Whether the loss must be kept per sequence (not summed) for `after_backward`.
    needs_row_losses = False

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


class DatasetLossHook(StepHook):
    """A mixture's loss per dataset: each sequence's loss, summed by its dataset."""

    needs_row_losses = True

    def __init__(
        self,
        names: list[str],
        device: torch.device,
        *,
        data_group: dist.ProcessGroup | None,
        pipeline_group: dist.ProcessGroup | None,
    ):
        self.losses = DatasetLosses(names, device)
        self.data_group, self.pipeline_group = data_group, pipeline_group
        self.dataset_ids: list[torch.Tensor] = []

    def before_step(self, batch: StepBatch, micro_batches) -> None:
        self.dataset_ids = batch.dataset_ids

    def after_backward(self, index: int, losses: torch.Tensor, labels: torch.Tensor) -> None:
        self.losses.add(losses, labels, self.dataset_ids[index])

    def records(self) -> dict[str, float]:
        return self.losses.reduce(data_group=self.data_group, pipeline_group=self.pipeline_group)


class ExpertParallelHook(StepHook):
    """What expert parallel's all-to-alls moved in the step (kiln/metrics/expert_parallel_records.py)."""

    def __init__(self, step: ExpertParallelStep):
        self.step = step

    def before_step(self, batch: StepBatch, micro_batches) -> None:
        self.step.start()

    def after_update(self, *, skipped: bool) -> None:
        self.step.end()

    def records(self) -> dict[str, float]:
        return self.step.records()
