"""Mixture-of-Experts balancing in the training step: the auxiliary losses normalized over the
whole step like the main loss, the expert biases moved by the step's loads, warnings for idle
experts, and the step's MoE records (kiln/metrics/moe_records.py)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from kiln.config import JobConfig
from kiln.data.loader import StepBatch
from kiln.log import warn
from kiln.metrics.idle_experts import IdleExperts
from kiln.metrics.moe_records import MoEStep, moe_layer_names, moe_records
from kiln.model.moe import (
    AuxLossScale,
    take_aux_loss_sums,
    update_expert_biases,
)
from kiln.parallel.collectives import sum_over
from kiln.parallel.mesh import ParallelContext
from kiln.train.step_hook import StepHook


class MoEBalancing(StepHook):
    """Built from the config, not this rank's modules: a pipeline rank whose stages hold no MoE
    layer still joins the collectives of the MoE records."""

    def __init__(
        self,
        cfg: JobConfig,
        parallel: ParallelContext,
        *,
        model_parts: list[nn.Module],
        grad_scale: float,
        pipeline_group: dist.ProcessGroup | None,
    ):
        self.model_parts, self.grad_scale = model_parts, grad_scale
        self.bias_update_rate = cfg.model.moe.bias_update_rate
        self.data_ranks, self.pipeline_group = parallel.data_ranks, pipeline_group
        # The ranks holding the other tokens of a micro-batch (data, cp and tp ranks), and those
        # holding the other parts of this rank's sequences (cp and tp ranks). Created here, on
        # every rank at once, as creating a group requires.
        self.token_group = parallel.token_group()
        self.sequence_group = parallel.sequence_group()
        self.idle_experts = IdleExperts(
            moe_layer_names(model_parts), patience=cfg.metrics.idle_expert_warn_steps
        )
        # Each rank's loads are its token group's sums: one rank of each group says it.
        self.says_idle = self.token_group is None or dist.get_rank(self.token_group) == 0
        self.step: MoEStep | None = None
        self.scale: AuxLossScale | None = None
        self.logged = True

    def start_step(self, *, logged: bool) -> None:
        self.logged = logged

    def before_step(
        self, batch: StepBatch, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """MoE auxiliary losses are normalized over the whole step, like the main loss: by the
        step's tokens and sequences on all data ranks (every token counts, masked or not).

        The load-balance loss takes f_e from the expert counts of the whole micro-batch: summed
        over the data ranks and the tp ranks, which hold its other tokens. It then equals one
        process's on the same micro-batches (same batch_size × data ranks and grad_accum_steps;
        under pipeline parallel one process whose micro-batches are the pipeline's). The
        sequence-wise loss counts whole sequences: summed over the cp and tp ranks. Only a logged
        step computes the losses without a weight, for its records."""
        tokens = sum(inputs.numel() for inputs, _ in micro_batches) * self.data_ranks
        sequences = sum(inputs.shape[0] for inputs, _ in micro_batches) * self.data_ranks
        self.scale = AuxLossScale(
            per_token=self.grad_scale / tokens,
            per_sequence=self.grad_scale / sequences,
            reduce_counts=_sum_over(self.token_group),
            reduce_sequence_counts=_sum_over(self.sequence_group),
            record=self.logged,
        )
        self.step = MoEStep(None, None, tokens=tokens, sequences=sequences)

    def forward_kwargs(self) -> dict[str, AuxLossScale]:
        return {"moe_scale": self.scale} if self.scale is not None else {}

    def after_update(self, *, skipped: bool) -> None:
        """Move the expert biases by the step's loads summed over the token group (the same
        update on every rank; a skipped step only restarts the counts), and keep the step's
        loads and balancing-loss sums for its records."""
        rate = 0.0 if skipped else self.bias_update_rate
        loads = update_expert_biases(self.model_parts, rate, all_reduce=_sum_over(self.token_group))
        sums = take_aux_loss_sums(self.model_parts)
        self.step = self.step._replace(loads=loads, aux_loss_sums=sums)
        if loads is not None:
            self.idle_experts.update(loads)

    def records(self) -> dict[str, float]:
        # The idle experts are named at logged steps: their counts stay on the device between.
        for message in self.idle_experts.messages():
            if self.says_idle:
                warn(message)
        if self.step is None:
            return {}
        return moe_records(
            self.model_parts,
            self.step,
            token_group=self.token_group,
            pipeline_group=self.pipeline_group,
        )


def _sum_over(group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    return partial(sum_over, group=group) if group is not None else None
