"""One optimizer step over a global batch, the same in every layout: count the step's valid
tokens over all data ranks before any backward, forward/backward each micro-batch on the loss
normalized by that count, sum tied-weight gradients, clip, agree across ranks (non-finite values,
stop requests, background saves), then update with the scheduled learning rate or skip."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from kiln.config import JobConfig
from kiln.data.dataset import TokenDataset
from kiln.data.loader import Source, StepBatch
from kiln.data.mixture import lr_scale_at
from kiln.metrics.expert_parallel_records import ExpertParallelStep
from kiln.metrics.idle_experts import IdleExperts
from kiln.metrics.logger import warn
from kiln.metrics.moe_records import MoEStep, moe_layer_names, moe_records
from kiln.metrics.param_norms import param_grad_norms
from kiln.model.document_mask import document_ids
from kiln.model.moe import (
    AuxLossScale,
    set_aux_loss_scale,
    take_aux_loss_sums,
    update_expert_biases,
)
from kiln.parallel.agree import any_rank
from kiln.parallel.collectives import sum_over
from kiln.parallel.context_parallel import ContextParallel
from kiln.parallel.expert_parallel import expert_parallel_stats
from kiln.parallel.float8 import precompute_float8_scales
from kiln.parallel.forward_backward import ForwardBackward
from kiln.parallel.fsdp import gradient_average_compensation
from kiln.parallel.mesh import ParallelContext
from kiln.parallel.mixed_precision import training_autocast
from kiln.parallel.pipeline import TiedEmbedding
from kiln.resilience.nan_injection import NanInjection
from kiln.train.dataset_losses import DatasetLosses
from kiln.train.evaluate import eval_loader, evaluate
from kiln.train.grad_norm import clip_grad_norm
from kiln.train.loss import chunked_token_loss_sum, count_valid, token_loss_sum
from kiln.train.schedule import lr_factor


class StepResult(NamedTuple):
    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    tokens: int
    finite: bool  # False: the update was skipped
    stop: bool  # some rank was signalled (SIGTERM/SIGUSR1/SIGINT)
    time_up: bool  # rank 0 found train.time_limit_minutes close
    save_written: bool  # every rank has written its part of the save in flight
    param_grad_norms: dict[str, float] | None = None  # metrics.param_grad_norms


class TrainStep:
    def __init__(
        self,
        cfg: JobConfig,
        parallel: ParallelContext,
        *,
        model_parts: list[nn.Module],
        optimizers: list[list[torch.optim.Optimizer]],
        sources: list[Source],
    ):
        self.cfg, self.parallel, self.device = cfg, parallel, parallel.device
        self.model_parts, self.optimizers = model_parts, optimizers
        pipelined = parallel.degrees["pp"] > 1
        self.pipeline_group = parallel.mesh["pp"].get_group() if pipelined else None
        tied = pipelined and cfg.model.tie_embeddings
        self.tied = TiedEmbedding(model_parts, cfg, parallel) if tied else None
        self.duplicates = self.tied.duplicates if self.tied is not None else ()
        # A mixture logs each dataset's loss: the loss is then kept per sequence.
        names = [source.name for source in sources]
        self.dataset_losses = DatasetLosses(names, self.device) if len(names) > 1 else None
        # A mixture's datasets share one tokenizer (checked at start-up), so one EOS id.
        self.eos_id = sources[0].eos_id
        self.nan_injection = NanInjection(
            cfg.resilience.debug_nan_steps, rank=parallel.rank, world_size=parallel.world_size
        )
        # The chunked loss applies the output head itself, chunk by chunk: the model (the last
        # pipeline stage) ends at the final norm. FSDP keeps the head gathered from the root
        # unit's forward to its backward (kiln/parallel/fsdp.py), when the loss reads it.
        self.chunked = cfg.train.loss == "chunked_cross_entropy"
        for part in model_parts:
            part.applies_head = not self.chunked
        self.head_part = next((part for part in model_parts if part.norm is not None), None)
        self.forward_backward = ForwardBackward(
            model_parts,
            cfg,
            parallel,
            loss_fn=self._loss,
            autocast=training_autocast(cfg, parallel),
            per_row=self.dataset_losses is not None,
        )
        # FSDP averages gradients; the loss is already normalized, so the average is undone.
        self.grad_scale = gradient_average_compensation(parallel.fsdp_mesh())
        # per_step: micro-batch gradients accumulate unsharded and are reduced once.
        self.defer_grad_reduce = (
            parallel.fsdp_mesh() is not None
            and cfg.distributed.grad_reduce == "per_step"
            and not pipelined
        )
        # From the config, not this rank's modules: a pipeline rank whose stages hold no MoE
        # layer still joins the collectives of the MoE records.
        self.moe = cfg.model.num_experts > 0
        # The ranks holding the other tokens of a micro-batch (data, cp and tp ranks), and those
        # holding the other parts of this rank's sequences (cp and tp ranks). Created here, on
        # every rank at once, as creating a group requires.
        self.token_group = parallel.token_group() if self.moe else None
        self.sequence_group = parallel.sequence_group() if self.moe else None
        # Context parallel: this rank keeps its chunks of every sequence it reads.
        cp_mesh = parallel.cp_mesh()
        self.context = ContextParallel(cp_mesh) if cp_mesh is not None else None
        self.moe_step: MoEStep | None = None
        self.idle_experts = IdleExperts(
            moe_layer_names(model_parts), patience=cfg.metrics.idle_expert_warn_steps
        )
        # Each rank's loads are its token group's sums: one rank of each group says it.
        self.says_idle = self.token_group is None or dist.get_rank(self.token_group) == 0
        stats = expert_parallel_stats(model_parts)
        self.expert_parallel = (
            ExpertParallelStep(stats, parallel.ep_mesh().get_group()) if stats else None
        )

    def __call__(self, batch: StepBatch, *, step: int, flags: dict[str, bool]) -> StepResult:
        """Step number `step` (1-based) over `batch`; `flags` (stop, time_up, save_pending) are
        this rank's, agreed with the others' in the step's one small all-reduce."""
        self.nan_injection.start_step(step)
        if self.expert_parallel is not None:
            self.expert_parallel.start()
        read = [
            (to_device(x, self.device), to_device(y, self.device)) for x, y in batch.micro_batches
        ]
        micro_batches = [self._prepare(inputs, labels) for inputs, labels in read]
        # This rank's valid tokens, summed over the ranks holding the others (data and cp);
        # clamp: a step whose tokens are all masked contributes zero, not NaN.
        valid = sum(count_valid(labels) for _, labels, _ in micro_batches)
        valid = sum_over(valid, self.parallel.data_group()).clamp(min=1)
        total = torch.zeros((), device=self.device)
        if self.moe:
            self._set_moe_normalization(read)
        for index, (inputs, labels, kwargs) in enumerate(micro_batches):
            if self.defer_grad_reduce:
                self.model_parts[0].set_requires_gradient_sync(index == len(micro_batches) - 1)
            losses = self.forward_backward(inputs, labels, kwargs, scale=self.grad_scale / valid)
            total += losses.sum()
            if self.dataset_losses is not None:
                self.dataset_losses.add(losses, labels, batch.dataset_ids[index])
        if self.tied is not None:
            self.tied.sync_grads()
        per_param = None
        if self.cfg.metrics.param_grad_norms:
            per_param = param_grad_norms(
                self.model_parts, pipeline_group=self.pipeline_group, duplicates=self.duplicates
            )
        grad_norm = clip_grad_norm(
            [p for part in self.model_parts for p in part.parameters()],
            self.cfg.train.grad_clip_norm,
            pipeline_group=self.pipeline_group,
            duplicates=self.duplicates,
        )
        # Only the last pipeline stage computed the loss; the sum over stages brings it to all.
        loss = sum_over(sum_over(total, self.pipeline_group), self.parallel.data_group()) / valid
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        if self.parallel.world_size == 1:
            # Nothing to agree on: the host flags stay on the host (each would be a copy to the
            # GPU that waits for it) and the one read of `finite` is the step's one wait.
            agreed = {"non_finite": not bool(finite)} | {k: bool(v) for k, v in flags.items()}
        else:
            agreed = any_rank({"non_finite": ~finite, **flags}, device=self.device)
        lr = self._update(step, skip=agreed["non_finite"])
        if self.moe:
            self._end_moe_step(skipped=agreed["non_finite"])
        if self.expert_parallel is not None:
            self.expert_parallel.end()
        tokens = sum(inputs.numel() for inputs, _ in read) * self.parallel.data_ranks
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
        )

    def _set_moe_normalization(
        self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """MoE auxiliary losses are normalized over the whole step, like the main loss: by the
        step's tokens and sequences on all data ranks (every token counts, masked or not).

        The load-balance loss takes f_e from the expert counts of the whole micro-batch: summed
        over the data ranks and the tp ranks, which hold its other tokens. It then equals one
        process's on the same micro-batches (same batch_size × data ranks and grad_accum_steps;
        under pipeline parallel one process whose micro-batches are the pipeline's). The
        sequence-wise loss counts whole sequences: summed over the cp and tp ranks.
        `micro_batches`: as read, whole sequences."""
        ranks = self.parallel.data_ranks
        tokens = sum(inputs.numel() for inputs, _ in micro_batches) * ranks
        sequences = sum(inputs.shape[0] for inputs, _ in micro_batches) * ranks
        scale = AuxLossScale(
            per_token=self.grad_scale / tokens,
            per_sequence=self.grad_scale / sequences,
            reduce_counts=_sum_over(self.token_group),
            reduce_sequence_counts=_sum_over(self.sequence_group),
        )
        for part in self.model_parts:
            set_aux_loss_scale(part, scale)
        self.moe_step = MoEStep(None, None, tokens=tokens, sequences=sequences)

    def _end_moe_step(self, *, skipped: bool) -> None:
        """Move the expert biases by the step's loads summed over the token group (the same
        update on every rank; a skipped step only restarts the counts), and keep the step's
        loads and balancing-loss sums for its records."""
        rate = 0.0 if skipped else self.cfg.model.moe_bias_update_rate
        loads = update_expert_biases(self.model_parts, rate, all_reduce=_sum_over(self.token_group))
        sums = take_aux_loss_sums(self.model_parts)
        self.moe_step = self.moe_step._replace(loads=loads, aux_loss_sums=sums)
        if loads is not None:
            for message in self.idle_experts.update(loads):
                if self.says_idle:
                    warn(message)

    def moe_records(self) -> dict[str, float]:
        """The last step's MoE records (see `moe_records`) and, under expert parallel, what its
        all-to-alls moved; every rank calls it at once."""
        if self.moe_step is None:
            return {}
        moved = self.expert_parallel.records() if self.expert_parallel is not None else {}
        return moved | moe_records(
            self.model_parts,
            self.moe_step,
            token_group=self.token_group,
            pipeline_group=self.pipeline_group,
        )

    def _update(self, step: int, *, skip: bool) -> float:
        lr = (
            self.cfg.optimizer.lr
            * lr_factor(self.cfg.scheduler, step, self.cfg.train.max_steps)
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

    def dataset_records(self) -> dict[str, float]:
        """Each dataset's mean loss since the last call (a mixture only)."""
        if self.dataset_losses is None:
            return {}
        return self.dataset_losses.reduce(
            data_group=self.parallel.data_group(), pipeline_group=self.pipeline_group
        )

    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Token-loss sums from the model's output: logits, or with the chunked loss the final
        norm's output."""
        train, per_row = self.cfg.train, self.dataset_losses is not None
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
                output, labels, z_loss_weight=train.z_loss_weight, per_row=per_row
            )
        return self.nan_injection.apply(losses)

    def _eval_forward(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-loss sums and valid tokens of this rank's part of an eval batch."""
        inputs, labels, kwargs = self._prepare(inputs, labels)
        losses = self.forward_backward(inputs, labels, kwargs, scale=None)
        return losses, count_valid(labels)

    def _prepare(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Inputs, labels and model arguments of this rank's part of a micro-batch: under
        context parallel its chunks of each sequence (document ids taken on whole sequences)."""
        kwargs = {}
        if self.cfg.data.document_mask:
            kwargs["document_ids"] = document_ids(inputs, self.eos_id)
        if self.context is None:
            return inputs, labels, kwargs
        return self.context.shard_batch(inputs, labels, kwargs)


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


def _sum_over(group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    return partial(sum_over, group=group) if group is not None else None
