"""One forward and backward pass over a batch, the same call whether the model runs whole on this
rank or as pipeline stages under a schedule: the trainer never branches on pipeline parallel.

The loss function returns token-loss sums (one per sequence when the loss is split by dataset);
the backward runs on sum · scale, where scale is the step's normalization (1 / global valid
tokens, times the FSDP average compensation). Under pipeline parallel the schedule calls the loss
once per micro-batch on the last stage; the sums are kept to report the batch's loss, in batch
order, and are zero on the other stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import record_function

from kiln.config.sections import JobConfig
from kiln.parallel.mesh import ParallelContext
from kiln.parallel.pipeline import build_schedule

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Pipeline schedules kept at once: the training shape and one other (see ForwardBackward._schedule).
KEPT_SCHEDULES = 2


class ForwardBackward:
    def __init__(
        self,
        model_parts: list[nn.Module],
        cfg: JobConfig,
        parallel: ParallelContext,
        *,
        loss_fn: LossFn,
        autocast: contextlib.AbstractContextManager,
        per_row: bool,
    ):
        self.model_parts, self.loss_fn = model_parts, loss_fn
        self.autocast, self.per_row, self.device = autocast, per_row, parallel.device
        # Under tensor parallel the logits stay vocabulary-sharded into the loss.
        self.loss_context = loss_parallel if parallel.degrees["tp"] > 1 else contextlib.nullcontext
        self.cfg, self.parallel = cfg, parallel
        self.pipelined = parallel.degrees["pp"] > 1
        self.first_stage = any(part.stage.first for part in model_parts)
        # Pipeline schedules by pass shape, most recently used last (see `_schedule`).
        self._schedules: dict[tuple[int, ...], Any] = {}
        self._sums: dict[int, torch.Tensor] = {}
        self._scale = torch.ones(())

    def __call__(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        kwargs: dict[str, torch.Tensor],
        options: dict[str, Any],
        *,
        scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """Token-loss sum of the batch (per sequence when split by dataset), after the backward
        of sum · scale; `scale` None: forward only (eval). `kwargs`: the model's per-sequence
        arguments (document ids, positions), shaped (batch, seq) like the inputs; `options`: its
        other arguments, the same for every sequence (see the family's forward)."""
        if self.pipelined:
            return self._pipelined(inputs, labels, kwargs, options, scale=scale)
        with self.loss_context():
            # The loss too: the chunked loss runs the output head (cross entropy is fp32 anyway).
            with self.autocast, record_function("forward"):
                output = self.model_parts[0](inputs, **kwargs, **options)
                losses = self.loss_fn(output, labels)
            # The backward needs what the loss saved, not the logits: holding them would keep a
            # logits-sized buffer alive through the backward's peak.
            del output
            if scale is not None:
                with record_function("backward"):
                    (losses.sum() * scale).backward()
        return _full(losses.detach())

    def _pipelined(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        kwargs: dict[str, torch.Tensor],
        options: dict[str, Any],
        *,
        scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """One batch through the schedule, which splits it into micro-batches (and hands every
        micro-batch the same `options`: the schedule replicates what is not a tensor)."""
        self._sums.clear()
        self._scale = scale if scale is not None else torch.ones((), device=self.device)
        losses: list[torch.Tensor] = []
        schedule = self._schedule(inputs.shape)
        run = schedule.step if scale is not None else schedule.eval
        phase = "pipeline forward-backward" if scale is not None else "pipeline forward"
        with self.loss_context(), self.autocast, record_function(phase):
            # Keyword arguments reach every stage (split into micro-batches like the inputs), so
            # each stage builds the attention mask from what every rank has read. Contiguous:
            # torch 2.11's first stage checks each micro-batch's strides against those it
            # inferred, and the loader's inputs are views of rows one token longer.
            run(
                *((inputs.contiguous(),) if self.first_stage else ()),
                target=labels,
                losses=losses,
                return_outputs=False,
                **{name: value.contiguous() for name, value in kwargs.items()},
                **options,
            )
        if not losses:
            return torch.zeros(labels.shape[:1] if self.per_row else (), device=self.device)
        # `losses` holds exactly this pass's micro-batch losses (a schedule's first pass also runs
        # the loss once more to infer shapes); each maps back to its unnormalized sum, in order.
        sums = [self._sums[id(loss)] for loss in losses]
        return _full(torch.cat(sums) if self.per_row else torch.stack(sums).sum())

    def _schedule(self, shape: torch.Size):
        """The schedule for passes of `shape` (rows, sequence length), built on first use: a
        schedule's stages learn the tensors they exchange from its first pass and keep receive
        buffers of that shape, so a sequence-length phase, and held-out evaluation at
        train.seq_len during one, each need their own. Every rank reads the same shape at the
        same pass, so all build it together. Two are kept, the shape in use and the last other
        one (evaluation's during a phase): an earlier phase's buffers are freed when the next
        begins."""
        key = tuple(shape)
        schedule = self._schedules.pop(key, None)
        if schedule is None:
            if len(self._schedules) >= KEPT_SCHEDULES:
                del self._schedules[next(iter(self._schedules))]
            schedule = build_schedule(
                self.model_parts, self.cfg, self.parallel, loss_fn=self._stage_loss, rows=key[0]
            )
        self._schedules[key] = schedule
        return schedule

    def _stage_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The schedule's loss for one micro-batch, normalized like the unpipelined step's."""
        losses = self.loss_fn(logits, labels)
        loss = losses.sum() * self._scale
        self._sums[id(loss)] = losses.detach()
        return loss


def _full(value: torch.Tensor) -> torch.Tensor:
    """A loss computed from vocabulary-sharded logits is a DTensor; the plain number is wanted."""
    return value.full_tensor() if isinstance(value, DTensor) else value
