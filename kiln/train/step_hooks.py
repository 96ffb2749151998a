"""The features that plug into the training step (kiln/train/step_hook.py says how): a mixture's
per-dataset losses, a model's own losses (multi-token prediction), expert parallel's traffic,
Mixture-of-Experts balancing (moe_step.py), and which of them a job runs."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kiln.config import JobConfig
from kiln.data.loader import Source, StepBatch
from kiln.metrics.expert_parallel_records import ExpertParallelStep
from kiln.parallel.expert_parallel import expert_parallel_stats
from kiln.parallel.mesh import ParallelContext
from kiln.train.dataset_losses import DatasetLosses
from kiln.train.moe_step import MoEBalancing
from kiln.train.step_hook import StepHook


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


class ModelLossHook(StepHook):
    """The losses a model adds to the main one (multi-token prediction's per depth): the mean
    per token of the logged step over all data ranks, from the model's `take_losses` (on the
    pipeline stage that computes them)."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        device: torch.device,
        *,
        data_group: dist.ProcessGroup | None,
        pipeline_group: dist.ProcessGroup | None,
    ):
        self.model_parts, self.device = model_parts, device
        self.data_group, self.pipeline_group = data_group, pipeline_group
        self.names = model_parts[0].loss_names()

    def before_step(self, batch: StepBatch, micro_batches) -> None:
        for part in self.model_parts:  # drop what earlier, unlogged steps counted
            part.take_losses()

    def records(self) -> dict[str, float]:
        sums = torch.zeros(len(self.names), 2, dtype=torch.float64, device=self.device)
        for part in self.model_parts:
            for name, pair in part.take_losses().items():
                sums[self.names.index(name)] += pair.double()
        for group in (self.pipeline_group, self.data_group):
            if group is not None:
                dist.all_reduce(sums, group=group)
        return {
            name: (loss / tokens).item()
            for name, (loss, tokens) in zip(self.names, sums, strict=True)
            if tokens > 0
        }


def step_hooks(
    cfg: JobConfig,
    parallel: ParallelContext,
    model_parts: list[nn.Module],
    sources: list[Source],
    *,
    grad_scale: float,
) -> list[StepHook]:
    """The hooks this job's step runs, in the order their records are logged."""
    pipeline_group = parallel.mesh["pp"].get_group() if parallel.degrees["pp"] > 1 else None
    hooks: list[StepHook] = []
    if len(sources) > 1:  # a mixture logs each dataset's loss
        names = [source.name for source in sources]
        data_group = parallel.data_group()
        hooks.append(
            DatasetLossHook(
                names, parallel.device, data_group=data_group, pipeline_group=pipeline_group
            )
        )
    if getattr(model_parts[-1], "adds_losses", False):
        hooks.append(
            ModelLossHook(
                model_parts,
                parallel.device,
                data_group=parallel.data_group(),
                pipeline_group=pipeline_group,
            )
        )
    stats = expert_parallel_stats(model_parts)
    if stats is not None:
        hooks.append(ExpertParallelHook(ExpertParallelStep(stats, parallel.ep_mesh().get_group())))
    if cfg.model.moe.num_experts > 0:
        hooks.append(
            MoEBalancing(
                cfg,
                parallel,
                model_parts=model_parts,
                grad_scale=grad_scale,
                pipeline_group=pipeline_group,
            )
        )
    return hooks
