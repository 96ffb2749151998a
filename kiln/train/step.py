"""One optimizer step over a global batch, the same in every layout: count the step's valid
tokens over all data ranks before any backward, forward/backward each micro-batch on the loss
normalized by that count, sum tied-weight gradients, clip, agree across ranks (non-finite values,
stop requests, background saves), then update with the scheduled learning rate or skip.

That is the dense core, `TrainStep.__call__`. Features that add to it (a mixture's per-dataset
losses, expert-parallel traffic, MoE balancing) plug in as hooks (kiln/train/step_hooks.py)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

import torch
from torch import nn
from torch.profiler import record_function

from kiln.config import JobConfig
from kiln.config.training_schedule import TrainingSchedule
from kiln.data.dataset import TokenDataset
from kiln.data.loader import Source, StepBatch
from kiln.data.mixture import lr_scale_at
from kiln.metrics.param_norms import ParamGradNorms, param_grad_norms
from kiln.metrics.step_records import log_due
from kiln.model.document_mask import document_ids
from kiln.model.forward_args import LossScale
from kiln.parallel.agree import any_rank
from kiln.parallel.collectives import sum_over
from kiln.parallel.context_parallel import ContextParallel
from kiln.parallel.float8 import precompute_float8_scales
from kiln.parallel.forward_backward import ForwardBackward
from kiln.parallel.fsdp import gradient_average_compensation
from kiln.parallel.mesh import ParallelContext
from kiln.parallel.mixed_precision import training_autocast
from kiln.parallel.pipeline import tied_weights
from kiln.parallel.replica_groups import ReplicaGroups
from kiln.resilience.nan_injection import NanInjection
from kiln.resilience.spike_guard import Crossed, SpikeGuard
from kiln.train.evaluate import eval_loader, evaluate
from kiln.train.grad_norm import clip_grad_norm
from kiln.train.loss import chunked_token_loss_sum, count_valid, token_loss_sum
from kiln.train.schedule import lr_factor, lr_horizon
from kiln.train.step_hooks import step_hooks


@dataclass(frozen=True)
class StepFlags:
    """This rank's requests for the step, agreed with every rank's in its one small all-reduce."""

    stop: bool = False  # signalled (SIGTERM/SIGUSR1/SIGINT)
    time_up: bool = False  # rank 0 found train.time_limit_minutes close
    save_pending: bool = False  # this rank's part of the save in flight is not written yet


class StepResult(NamedTuple):
    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    tokens: int
    finite: bool  # False: the update was skipped
    stop: bool  # some rank was signalled (SIGTERM/SIGUSR1/SIGINT)
    time_up: bool  # rank 0 found train.time_limit_minutes close
    save_written: bool  # every rank has written its part of the save in flight
    # metrics.param_grad_norms, on the device: `.read()` at a logged step (every rank at once).
    param_grad_norms: ParamGradNorms | None = None
    # Fault tolerance: False when a replica group failed during the step (nothing updated).
    committed: bool = True
    # Loss-spike skipping: whether the update was skipped as a spike (on any rank), the
    # thresholds this rank saw crossed, and whether resilience.spike_max_consecutive came in a row.
    spike: bool = False
    crossed: tuple[Crossed, ...] = ()
    spike_limit: bool = False


class TrainStep:
    def __init__(
        self,
        cfg: JobConfig,
        parallel: ParallelContext,
        *,
        model_parts: list[nn.Module],
        optimizers: list[list[torch.optim.Optimizer]],
        sources: list[Source],
        replicas: ReplicaGroups | None = None,
    ):
        self.cfg, self.parallel, self.device = cfg, parallel, parallel.device
        # Fault tolerance: what HSDP sums over dp_replicate is summed over the live groups.
        self.replicas = replicas
        # Under FSDP the gradients cross the groups during the backward; else after it.
        self.sums_in_backward = replicas is not None and replicas.sum_in_backward(model_parts)
        self.model_parts, self.optimizers = model_parts, optimizers
        pipelined = parallel.degrees["pp"] > 1
        self.pipeline_group = parallel.mesh["pp"].get_group() if pipelined else None
        self.tied = tied_weights(model_parts, cfg, parallel)
        self.duplicates = self.tied.duplicates if self.tied is not None else ()
        # A mixture's datasets share one tokenizer (checked at start-up), so one EOS id.
        self.eos_id = sources[0].eos_id
        self.spikes = SpikeGuard(cfg.resilience) if cfg.resilience.spike_action == "skip" else None
        self.nan_injection = NanInjection(
            cfg.resilience.debug_nan_steps, rank=parallel.rank, world_size=parallel.world_size
        )
        # FSDP averages gradients; the loss is already normalized, so the average is undone.
        self.grad_scale = gradient_average_compensation(parallel.fsdp_mesh())
        self.hooks = step_hooks(cfg, parallel, model_parts, sources, grad_scale=self.grad_scale)
        self.per_row = any(hook.needs_row_losses for hook in self.hooks)
        # The chunked loss applies the output head itself, chunk by chunk: the model (the last
        # pipeline stage) ends at the final norm. FSDP keeps the head gathered from the root
        # unit's forward to its backward (kiln/parallel/fsdp.py), when the loss reads it.
        self.chunked = cfg.train.loss == "chunked_cross_entropy"
        self.head_part = next((part for part in model_parts if part.stage.last), None)
        self.forward_backward = ForwardBackward(
            model_parts,
            cfg,
            parallel,
            loss_fn=self._loss,
            autocast=training_autocast(cfg, parallel),
            per_row=self.per_row,
        )
        # per_step: micro-batch gradients accumulate unsharded and are reduced once.
        self.defer_grad_reduce = (
            parallel.fsdp_mesh() is not None
            and cfg.distributed.grad_reduce == "per_step"
            and not pipelined
        )
        # Context parallel: this rank keeps its chunks of every sequence it reads.
        cp_mesh = parallel.cp_mesh()
        mode = cfg.distributed.cp_mode
        self.context = ContextParallel(cp_mesh, mode=mode) if cp_mesh is not None else None
        # A model with losses of its own (multi-token prediction) takes the labels and the
        # step's scale of token-loss sums in training forwards (docs/models.md).
        self.model_adds_losses = getattr(model_parts[-1], "adds_losses", False)
        # The model's forward arguments every call of the job shares.
        self.forward_options = {"apply_head": not self.chunked, "context_parallel": self.context}
        # Where the learning-rate schedule stands: the step, or the tokens read in full steps.
        self.schedule = TrainingSchedule(cfg.train, data_ranks=parallel.data_ranks)
        self.lr_horizon = lr_horizon(cfg, self.schedule)

    def __call__(self, batch: StepBatch, *, step: int, flags: StepFlags) -> StepResult:
        """Step number `step` (1-based) over `batch`; `flags` are this rank's."""
        self.nan_injection.start_step(step)
        read = [
            (to_device(x, self.device), to_device(y, self.device)) for x, y in batch.micro_batches
        ]
        logged = log_due(self.cfg, step)
        for hook in self.hooks:
            hook.start_step(logged=logged)
            hook.before_step(batch, read)
        micro_batches = [self._prepare(inputs, labels, training=True) for inputs, labels in read]
        # This rank's valid tokens, summed over the ranks holding the others (data and cp);
        # clamp: a step whose tokens are all masked contributes zero, not NaN.
        valid = sum(count_valid(labels) for _, labels, _ in micro_batches)
        valid = sum_over(valid, self.parallel.data_group())
        if self.replicas is not None:
            self.replicas.sum([valid])
        valid = valid.clamp(min=1)
        total = torch.zeros((), device=self.device)
        options = self.forward_options | {
            k: v for h in self.hooks for k, v in h.forward_kwargs().items()
        }
        for index, (inputs, labels, kwargs) in enumerate(micro_batches):
            if self.defer_grad_reduce:
                self.model_parts[0].set_requires_gradient_sync(index == len(micro_batches) - 1)
            scale = self.grad_scale / valid
            if self.model_adds_losses:  # its losses are normalized like the main loss
                options = options | {"loss_scale": LossScale(scale)}
            losses = self.forward_backward(inputs, labels, kwargs, options, scale=scale)
            total += losses.sum()
            for hook in self.hooks:
                hook.after_backward(index, losses, labels)
        # Only the last pipeline stage computed the loss; the sum over stages brings it to all.
        total = sum_over(sum_over(total, self.pipeline_group), self.parallel.data_group())
        if self.replicas is not None:
            # A stop or time limit in any group stops every group at this step (summed in
            # the same collective as the gradients), so the writer saves it.
            stops = torch.tensor(
                [flags.stop, flags.time_up], dtype=total.dtype, device=total.device
            )
            if self.sums_in_backward:
                self.replicas.sum([total, stops])
            else:
                self.replicas.sum_gradients(self._params(), extra=[total, stops])
            flags = replace(flags, stop=bool(stops[0] > 0), time_up=bool(stops[1] > 0))
        grad_norm, per_param = self._clip()
        loss = total / valid
        values, crossed = self._spike_check(loss, grad_norm)
        agreed = self._agree(loss, grad_norm, flags, spike=bool(crossed), values=values)
        committed = self.replicas.commit(step) if self.replicas is not None else True
        skip = agreed["non_finite"] or agreed["spike"] or not committed
        lr = self._update(step, tokens_after=batch.tokens_after, skip=skip)
        limit = False
        if values is not None and committed and not agreed["non_finite"]:
            limit = self.spikes.record(*values, skipped=agreed["spike"])
        for hook in self.hooks:
            hook.after_update(skipped=skip)
        tokens = sum(inputs.numel() for inputs, _ in read) * self._live_data_ranks()
        return StepResult(
            loss,
            grad_norm,
            lr,
            tokens,
            finite=not agreed["non_finite"],
            stop=agreed["stop"],
            time_up=agreed["time_up"],
            save_written=not agreed["save_pending"],
            param_grad_norms=per_param,
            committed=committed,
            spike=agreed["spike"],
            crossed=tuple(crossed),
            spike_limit=limit,
        )

    def _params(self) -> list[nn.Parameter]:
        return [p for part in self.model_parts for p in part.parameters() if p.requires_grad]

    def _live_data_ranks(self) -> int:
        """The data ranks that trained this step: under fault tolerance, the live groups'."""
        if self.replicas is None:
            return self.parallel.data_ranks
        return self.parallel.group_data_ranks * self.replicas.last.participants

    def _clip(self) -> tuple[torch.Tensor, ParamGradNorms | None]:
        """Sum the tied weight's two gradients, then clip: the gradient norm before clipping, and
        each parameter's (metrics.param_grad_norms)."""
        if self.tied is not None:
            self.tied.sync_grads()
        per_param = None
        if self.cfg.metrics.param_grad_norms:
            per_param = param_grad_norms(
                self.model_parts, pipeline_group=self.pipeline_group, duplicates=self.duplicates
            )
        grad_norm = clip_grad_norm(
            self._params(),
            self.cfg.train.grad_clip_norm,
            pipeline_group=self.pipeline_group,
            duplicates=self.duplicates,
        )
        return grad_norm, per_param

    def _spike_check(
        self, loss: torch.Tensor, grad_norm: torch.Tensor
    ) -> tuple[list[float] | None, list[Crossed]]:
        """With spike skipping on: the step's loss and gradient norm on the host (a read a step)
        and the thresholds they cross; non-finite values are the NaN guard's."""
        if self.spikes is None:
            return None, []
        values = torch.stack([loss.double(), grad_norm.double()]).tolist()
        if not all(map(math.isfinite, values)):
            return values, []
        return values, self.spikes.crossed(*values)

    def _agree(
        self,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        flags: StepFlags,
        *,
        spike: bool,
        values: list[float] | None,
    ) -> dict[str, bool]:
        """Whether any rank saw a non-finite loss or gradient norm or a spike, or set a flag."""
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        if self.parallel.world_size == 1:
            # Nothing to agree on: the host flags stay on the host (each would be a copy to the
            # GPU that waits for it), and the step's one wait reads `finite` or the values.
            read = all(map(math.isfinite, values)) if values is not None else bool(finite)
            return {"non_finite": not read, "spike": spike} | asdict(flags)
        agreed = {"non_finite": ~finite, "spike": spike, **asdict(flags)}
        return any_rank(agreed, device=self.device)

    def state_dict(self) -> dict:
        """What a resume needs of the step beside the data position: the spike history."""
        return {"spike_guard": self.spikes.state_dict()} if self.spikes is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.spikes is not None and "spike_guard" in state:
            self.spikes.load_state_dict(state["spike_guard"])

    def records(self) -> dict[str, float]:
        """What the step's hooks add to a logged step (per-dataset losses, expert-parallel
        traffic, MoE balance); every rank calls it at once."""
        out: dict[str, float] = {}
        for hook in self.hooks:
            out |= hook.records()
        return out

    def _update(self, step: int, *, tokens_after: int, skip: bool) -> float:
        at = step
        if self.cfg.scheduler.unit == "tokens":
            at = tokens_after / self.schedule.full_step_tokens
        lr = (
            self.cfg.optimizer.lr
            * lr_factor(self.cfg.scheduler, at, self.lr_horizon)
            * lr_scale_at(self.cfg.data, step - 1)
        )
        factor = lr / self.cfg.optimizer.lr
        for optimizer in (o for part in self.optimizers for o in part):
            if not skip:
                for group in optimizer.param_groups:
                    # Checkpoints written before base_lr existed hold one AdamW at optimizer.lr.
                    group["lr"] = group.setdefault("base_lr", self.cfg.optimizer.lr) * factor
                with record_function("optimizer"):
                    optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if not skip:
            precompute_float8_scales(self.model_parts, self.cfg)
        return lr

    def evaluate(self, eval_data: TokenDataset) -> dict[str, float]:
        loader = eval_loader(
            eval_data,
            document_mask=self.cfg.data.document_mask,
            batch_size=self.cfg.train.batch_size,
            grad_accum_steps=self.cfg.train.grad_accum_steps,
            data_ranks=self.parallel.data_ranks,
            data_rank=self.parallel.data_rank,
        )
        return evaluate(
            loader,
            steps=self.cfg.eval.steps,
            forward=self._eval_forward,
            device=self.device,
            data_group=self.parallel.data_group(),
            pipeline_group=self.pipeline_group,
        )

    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Token-loss sums from the model's output: logits, or with the chunked loss the final
        norm's output."""
        train, per_row = self.cfg.train, self.per_row
        if self.chunked:
            losses = chunked_token_loss_sum(
                output,
                self.head_part.head_weight(),
                labels,
                chunk_tokens=train.loss_chunk_tokens,
                z_loss_weight=train.z_loss_weight,
                per_row=per_row,
            )
        else:
            losses = token_loss_sum(
                output,
                labels,
                z_loss_weight=train.z_loss_weight,
                per_row=per_row,
                compiled=train.compile,
            )
        return self.nan_injection.apply(losses)

    def _eval_forward(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-loss sums and valid tokens of this rank's part of an eval batch."""
        inputs, labels, kwargs = self._prepare(inputs, labels)
        losses = self.forward_backward(inputs, labels, kwargs, self.forward_options, scale=None)
        return losses, count_valid(labels)

    def _prepare(
        self, inputs: torch.Tensor, labels: torch.Tensor, *, training: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Inputs, labels and model arguments of this rank's part of a micro-batch: under
        context parallel its chunks of each sequence (document ids taken on whole sequences).
        A model with losses of its own takes the whole sequences' labels in training: its
        tokens ahead of a chunk's end sit in the next chunk."""
        kwargs = {}
        if self.cfg.data.document_mask:
            kwargs["document_ids"] = document_ids(inputs, self.eos_id)
        whole = {"labels": labels} if training and self.model_adds_losses else {}
        if self.context is not None:
            inputs, labels, kwargs = self.context.shard_batch(inputs, labels, kwargs)
        return inputs, labels, kwargs | whole


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, queued behind the device's work instead of waiting for it.

    A blocking copy to a GPU waits for every kernel already queued (the previous step's
    optimizer), and the GPU then idles until the host queues the next forward; a non-blocking
    one from pageable memory may wait too (CUDA stages it through page-locked memory). From
    page-locked, contiguous memory it is queued like a kernel. The loader's page-locked batch is
    sliced into inputs that are not contiguous: those are gathered into page-locked memory of
    their own first (a host copy of a few kilobytes), which the caching host allocator keeps
    until the copy has run."""
    if tensor.device == device or device.type == "cpu":
        return tensor.to(device)
    if tensor.is_pinned() and not tensor.is_contiguous():
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        tensor = pinned.copy_(tensor)
    return tensor.to(device, non_blocking=tensor.is_pinned())
