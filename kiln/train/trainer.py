"""The training loop. Reads like the recipe: mesh → model on meta → parallelize → materialize/load →
optimizer, schedule, data → loop (fetch, forward/backward per micro-batch, clip, step, log, checkpoint)."""

from __future__ import annotations

import contextlib
import os
import resource
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from kiln.checkpoint import (
    CheckpointSaver,
    latest_complete,
    load_checkpoint,
    read_train_state,
    resolve_checkpoint,
)
from kiln.checkpoint.fingerprint import fingerprint_changes, run_fingerprint
from kiln.checkpoint.layout import complete_steps, resume_candidates
from kiln.checkpoint.state import first_line
from kiln.config import JobConfig, to_toml, validate
from kiln.data.dataset import TokenDataset
from kiln.data.loader import BatchLoader, Source
from kiln.data.mixture import lr_scale_at
from kiln.data.sources import (
    ensure_local_data,
    open_eval_data,
    open_training_data,
    training_tokenizer,
)
from kiln.errors import ConfigError, KilnError
from kiln.metrics.logger import JSONL_NAME, MetricsLogger, read_metrics, truncate_after, warn
from kiln.metrics.mfu import mfu, peak_flops
from kiln.metrics.param_norms import param_grad_norms
from kiln.metrics.plot import plot_loss_curve
from kiln.model import build_model, flops_per_token, materialize
from kiln.model.document_mask import document_ids
from kiln.parallel.apply import apply_parallelism
from kiln.parallel.fsdp import gradient_average_compensation
from kiln.parallel.mesh import init_parallel
from kiln.parallel.pipeline import TiedEmbedding, build_schedule
from kiln.resilience import NanGuard, PreemptionFlag, StepWatchdog
from kiln.resilience.preemption import Preempted
from kiln.train.dataset_losses import DatasetLosses
from kiln.train.evaluate import eval_loader, evaluate
from kiln.train.grad_norm import clip_grad_norm
from kiln.train.loss import count_valid, token_loss_sum
from kiln.train.optimizer import build_optimizer
from kiln.train.schedule import lr_factor


class Trainer:
    def __init__(self, cfg: JobConfig, *, world_size: int | None = None):
        validate(cfg, world_size or int(os.environ.get("WORLD_SIZE", "1")))
        unsupported = [
            f"{d}={getattr(cfg.distributed, d)}"
            for d in ("cp", "ep")
            if getattr(cfg.distributed, d) > 1
        ]
        if unsupported:
            raise ConfigError(
                f"distributed {', '.join(unsupported)}: this version trains data parallel "
                "(dp_shard, dp_replicate), tensor parallel (tp) and pipeline parallel (pp); set these to 1"
            )
        self.cfg = cfg
        self.run_dir = Path(cfg.metrics.run_dir)
        self.checkpoint_dir = Path(cfg.checkpoint.dir or self.run_dir / "checkpoints")
        self._check_checkpoint_sources()  # before anything is built or written
        self.parallel = init_parallel(
            cfg.distributed,
            pick_device(cfg.train.device),
            timeout_s=cfg.resilience.collective_timeout_s,
        )
        self.device = self.parallel.device
        if cfg.checkpoint.interval or cfg.checkpoint.save_final:
            self._on_main(lambda: _check_writable(self.checkpoint_dir), what="write checkpoints")
        self.sources, self.eval_data = self._open_data()
        self.grad_scale = gradient_average_compensation(self.parallel.fsdp_mesh())
        pipelined = self.parallel.degrees["pp"] > 1
        # per_step: gradients of all micro-batches accumulate unsharded and are reduced once.
        # (A pipeline schedule does that itself within each pass.)
        self.defer_grad_reduce = (
            self.parallel.fsdp_mesh() is not None
            and cfg.distributed.grad_reduce == "per_step"
            and not pipelined
        )

        torch.manual_seed(cfg.train.seed)
        # The whole model, or under pipeline parallel the stages this rank runs.
        self.model_parts = apply_parallelism(build_model(cfg.model), cfg, self.parallel)
        for part in self.model_parts:
            materialize(part, device=self.device, seed=cfg.train.seed)
        self.optimizers = [build_optimizer(part, cfg.optimizer) for part in self.model_parts]
        self.pipeline = self.tied = self.pipeline_group = None
        if pipelined:
            self.pipeline_group = self.parallel.mesh["pp"].get_group()
            if cfg.model.tie_embeddings:
                self.tied = TiedEmbedding(self.model_parts, cfg, self.parallel)
            self.pipeline = build_schedule(
                self.model_parts, cfg, self.parallel, loss_fn=self._pipeline_loss
            )
            self._loss_sums: dict[int, torch.Tensor] = {}
        self.loader = BatchLoader(
            self.sources,
            cfg.data,
            seed=cfg.train.seed,
            batch_size=cfg.train.batch_size,
            grad_accum_steps=cfg.train.grad_accum_steps,
            data_ranks=self.parallel.data_ranks,
            data_rank=self.parallel.data_rank,
            num_workers=cfg.data.num_workers,
            prefetch_steps=cfg.data.prefetch_steps,
            pin_memory=self.device.type == "cuda",
        )
        # A mixture logs each dataset's loss: the loss is then kept per sequence.
        self.dataset_losses = (
            DatasetLosses([source.name for source in self.sources], self.device)
            if len(self.sources) > 1
            else None
        )
        self.step = 0
        self.tokens_seen = 0
        self.saver = CheckpointSaver(
            self.checkpoint_dir,
            keep_last_n=cfg.checkpoint.keep_last_n,
            async_mode=cfg.checkpoint.async_mode,
            device=self.device,
        )
        self.nan_guard = NanGuard(
            max_consecutive=cfg.resilience.nan_max_consecutive, action=cfg.resilience.nan_action
        )
        self._nan_steps_left = set(cfg.resilience.debug_nan_steps)
        self._inject_nan = False
        self._resume()
        # Only a run that could start records its config: a failed attempt leaves the run dir as it was.
        if self.parallel.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_atomically(self.run_dir / "config.toml", to_toml(cfg))
        self.autocast = self._autocast_context()
        self.loss_context = (
            loss_parallel if self.parallel.degrees["tp"] > 1 else contextlib.nullcontext
        )
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak_flops = peak_flops(self.device)

    def train(self) -> list[dict]:
        """Run to train.max_steps; return the logged records. Stops early, with a checkpoint,
        when the job is told to (SIGTERM/SIGUSR1: raises Preempted)."""
        preemption = PreemptionFlag()
        watchdog = StepWatchdog(self.cfg.resilience.step_timeout_s, rank=self.parallel.rank)
        try:
            records = self._loop(preemption, watchdog)
        except RuntimeError as error:
            if not _is_collective_failure(error):
                raise
            raise KilnError(
                f"rank {self.parallel.rank}: a collective failed during step {self.step + 1}: "
                f"{first_line(error)}. Another rank most likely died or hung (its log names "
                f"why); the job resumes from {latest_complete(self.checkpoint_dir) or 'scratch'} "
                "when restarted"
            ) from None
        finally:
            watchdog.close()
            preemption.restore()
        if self.parallel.is_main:
            self._summarize()
        return records

    def _loop(self, preemption: PreemptionFlag, watchdog: StepWatchdog) -> list[dict]:
        cfg = self.cfg
        logger = MetricsLogger(
            self.run_dir,
            max_steps=cfg.train.max_steps,
            start_step=self.step,
            jsonl=cfg.metrics.jsonl and self.parallel.is_main,
        )
        records, window, first = [], _Window(), True
        while self.step < cfg.train.max_steps:
            if not first:  # the first step compiles and warms up: no bound on it
                watchdog.arm(self.step + 1)
            result = self.train_step(stop_requested=preemption.received is not None)
            watchdog.disarm()
            first = False
            window.add(result.loss, result.tokens)
            run_eval = cfg.eval.interval and self.step % cfg.eval.interval == 0
            if (
                self.step % cfg.metrics.log_interval == 0
                or self.step in (1, cfg.train.max_steps)
                or run_eval
            ):
                record = self._record(result, window)
                if run_eval:
                    started = time.perf_counter()
                    record |= self.evaluate()
                    window.start += time.perf_counter() - started  # not training time
                if self.parallel.is_main:
                    logger.log(record)
                records.append(record)
                window = _Window()
            action = self.nan_guard.update(finite=result.finite)
            if action != "ok" and self._non_finite_step(action, result, logger):
                continue  # rolled back: nothing of this step to checkpoint
            if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                started = time.perf_counter()
                self.save()
                window.start += time.perf_counter() - started  # saving is not training time
            self.saver.poll()
            if result.stop:
                self._stop_for_preemption(preemption.received or "a signal on another rank")
        if cfg.checkpoint.save_final and self._newest_saved_step() != self.step:
            self.save()
        self.saver.close()
        return records

    def _non_finite_step(self, action: str, result: StepResult, logger: MetricsLogger) -> bool:
        """The update of this step was skipped; after too many in a row (`action` 'stop' or
        'rollback'), stop or roll back (then return True)."""
        if self.parallel.is_main:
            warn(
                f"step {self.step}: non-finite loss or gradient norm (loss {result.loss.item()}, "
                f"grad_norm {result.grad_norm.item()}); the update was skipped "
                f"({self.nan_guard.consecutive} in a row, resilience.nan_max_consecutive = "
                f"{self.nan_guard.max_consecutive})"
            )
        if action == "stop":
            self.saver.close()
            raise KilnError(
                f"{self.nan_guard.consecutive} steps in a row up to step {self.step} had a "
                "non-finite loss or gradient norm; stopping. The newest checkpoint is "
                f"{latest_complete(self.checkpoint_dir) or '(none)'}. Lower optimizer.lr or "
                "train.grad_clip_norm, check the data, or set resilience.nan_action = 'rollback'"
            )
        if action == "rollback":
            self._rollback(logger)
        return action == "rollback"

    def _rollback(self, logger: MetricsLogger) -> None:
        """Back to the newest checkpoint's weights, optimizer and step; the data keeps going
        forward, so the batches that blew up are not replayed."""
        self.saver.wait()
        newest = latest_complete(self.checkpoint_dir)
        if newest is None:
            raise KilnError(
                f"resilience.nan_action = 'rollback' but there is no checkpoint before step "
                f"{self.step} to return to; lower checkpoint.interval"
            )
        bad_step = self.step
        state = load_checkpoint(newest, model=self.model_parts, optimizer=self.optimizers)
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.nan_guard.reset()
        if self.parallel.is_main:
            warn(f"rolled back from step {bad_step} to {newest}; the data continues forward")
            if logger.path is not None:
                truncate_after(logger.path, self.step)

    def _stop_for_preemption(self, signal_name: str) -> None:
        if self._newest_saved_step() != self.step:
            self.save()
        self.saver.close()
        raise Preempted(
            signal_name=signal_name, step=self.step, checkpoint=latest_complete(self.checkpoint_dir)
        )

    def _newest_saved_step(self) -> int | None:
        if self.saver.in_flight is not None:
            return self.saver.in_flight.step
        return latest_step(self.checkpoint_dir)

    def _summarize(self) -> None:
        history = read_metrics(self.run_dir / JSONL_NAME)
        plot = None
        if self.cfg.metrics.plot and history:
            plot = plot_loss_curve(self.run_dir / JSONL_NAME, self.run_dir / "loss_curve.png")
        lines = [f"kiln: finished step {self.step}"]
        if history:
            first, last = history[0]["loss_avg"], history[-1]["loss_avg"]
            lines.append(
                f"mean loss {first:.4f} (step {history[0]['step']}) -> {last:.4f} ({100 * last / first:.0f}% of first)"
            )
        newest = latest_complete(self.checkpoint_dir)
        if newest is not None:
            lines.append(f"checkpoint {newest}")
        if plot is not None:
            lines.append(f"loss curve {plot}")
        print(" | ".join(lines), flush=True)

    def train_step(self, *, stop_requested: bool = False) -> StepResult:
        """One optimizer step; skipped (no update) when any rank saw a non-finite loss or
        gradient norm. `stop` tells whether any rank was asked to stop (agreed by all)."""
        self._inject_nan = self.step + 1 in self._nan_steps_left
        self._nan_steps_left.discard(self.step + 1)
        batch = self.loader.next_step()
        micro_batches = [(x.to(self.device), y.to(self.device)) for x, y in batch.micro_batches]
        # Normalize by the valid tokens of the whole optimizer step, counted before any backward,
        # so every grad-accumulation split computes the gradient of the same loss.
        # clamp: a step whose tokens are all masked contributes zero, not NaN.
        valid = _sum_over(
            sum(count_valid(labels) for _, labels in micro_batches), self.parallel.data_group()
        )
        valid = valid.clamp(min=1)
        total = torch.zeros((), device=self.device)
        for index, (inputs, labels) in enumerate(micro_batches):
            if self.defer_grad_reduce:
                self.model_parts[0].set_requires_gradient_sync(index == len(micro_batches) - 1)
            losses = self._forward_backward(inputs, labels, scale=self.grad_scale / valid)
            total += losses.sum()
            if self.dataset_losses is not None:
                self.dataset_losses.add(losses, labels, batch.dataset_ids[index])
        if self.tied is not None:
            self.tied.sync_grads()
        duplicates = self.tied.duplicates if self.tied is not None else ()
        param_norms = (
            param_grad_norms(
                self.model_parts, pipeline_group=self.pipeline_group, duplicates=duplicates
            )
            if self.cfg.metrics.param_grad_norms
            else None
        )
        grad_norm = clip_grad_norm(
            [p for part in self.model_parts for p in part.parameters()],
            self.cfg.train.grad_clip_norm,
            pipeline_group=self.pipeline_group,
            duplicates=duplicates,
        )
        # Only the last pipeline stage computed the loss; the sum over stages brings it to all.
        total = _sum_over(total, self.pipeline_group)
        loss = _sum_over(total, self.parallel.data_group()) / valid
        finite, stop = self._agree(
            finite=torch.isfinite(loss) & torch.isfinite(grad_norm), stop=stop_requested
        )
        lr = (
            self.cfg.optimizer.lr
            * lr_factor(self.cfg.scheduler, self.step + 1, self.cfg.train.max_steps)
            * lr_scale_at(self.cfg.data, self.step)
        )
        for optimizer in self.optimizers:
            if finite:
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self.step += 1
        tokens = sum(inputs.numel() for inputs, _ in micro_batches) * self.parallel.data_ranks
        self.tokens_seen += tokens
        return StepResult(loss, grad_norm, lr, tokens, finite, stop, param_norms)

    def _agree(self, *, finite: torch.Tensor, stop: bool) -> tuple[bool, bool]:
        """(every rank finite, any rank asked to stop): one small all-reduce per step, so all
        ranks skip the same updates and stop at the same step boundary."""
        flags = torch.stack([(~finite).float(), torch.tensor(float(stop), device=self.device)])
        if self.parallel.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        non_finite, stop_any = flags.tolist()
        return not non_finite, bool(stop_any)

    def evaluate(self) -> dict[str, float]:
        loader = eval_loader(
            self.eval_data,
            document_mask=self.cfg.data.document_mask,
            batch_size=self.cfg.train.batch_size,
            grad_accum_steps=self.cfg.train.grad_accum_steps,
            data_ranks=self.parallel.data_ranks,
            data_rank=self.parallel.data_rank,
        )
        return evaluate(
            loader,
            steps=self.cfg.eval.steps,
            forward=lambda inputs, labels: self._forward_backward(inputs, labels, scale=None),
            device=self.device,
            data_group=self.parallel.data_group(),
            pipeline_group=self.pipeline_group,
        )

    def _forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, *, scale: torch.Tensor | None
    ) -> torch.Tensor:
        """Token-loss sum of one batch (per sequence when the loss is split by dataset), with the
        backward of loss_sum · scale; `scale` None: forward only (eval). Under pipeline parallel
        the loss lives on the last stage's ranks and is zero elsewhere."""
        if self.pipeline is not None:
            return self._pipeline_pass(inputs, labels, scale=scale)
        # Under tensor parallel the logits stay vocabulary-sharded into the loss.
        with self.loss_context():
            with self.autocast:
                logits = self.model_parts[0](inputs, **self._model_kwargs(inputs))
            losses = self._loss(logits, labels)
            if scale is not None:
                (losses.sum() * scale).backward()
        return _full(losses.detach())

    def _model_kwargs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.cfg.data.document_mask:
            return {}
        # A mixture's datasets share one tokenizer (checked at start-up), so one EOS id.
        return {"document_ids": document_ids(inputs, self.sources[0].eos_id)}

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses = token_loss_sum(
            logits,
            labels,
            z_loss_weight=self.cfg.train.z_loss_weight,
            per_row=self.dataset_losses is not None,
        )
        # resilience.debug_nan_steps: the last rank alone goes bad, so the others must learn it.
        if self._inject_nan and self.parallel.rank == self.parallel.world_size - 1:
            losses = losses * float("nan")
        return losses

    def _pipeline_pass(
        self, inputs: torch.Tensor, labels: torch.Tensor, *, scale: torch.Tensor | None
    ) -> torch.Tensor:
        """One batch through the pipeline schedule, which splits it into micro-batches."""
        self._loss_sums.clear()
        self._loss_scale = scale if scale is not None else torch.ones((), device=self.device)
        losses: list[torch.Tensor] = []
        first_stage = any(part.embeds_input for part in self.model_parts)
        run = self.pipeline.step if scale is not None else self.pipeline.eval
        with self.loss_context(), self.autocast:
            # Keyword arguments reach every stage (split into micro-batches like the inputs), so
            # each stage builds the document mask from the tokens every rank has read.
            run(
                *((inputs,) if first_stage else ()),
                target=labels,
                losses=losses,
                return_outputs=False,
                **self._model_kwargs(inputs),
            )
        if not losses:
            shape = labels.shape[:1] if self.dataset_losses is not None else ()
            return torch.zeros(shape, device=self.device)
        # `losses` holds exactly this pass's micro-batch losses (the first pass also runs the loss
        # once more to infer shapes); each maps back to its unnormalized sum, in batch order.
        sums = [self._loss_sums[id(loss)] for loss in losses]
        return _full(
            torch.cat(sums) if self.dataset_losses is not None else torch.stack(sums).sum()
        )

    def _pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The schedule's loss for one micro-batch, normalized like the unpipelined step's."""
        losses = self._loss(logits, labels)
        loss = losses.sum() * self._loss_scale
        self._loss_sums[id(loss)] = losses.detach()
        return loss

    def _open_data(self) -> tuple[list[Source], TokenDataset | None]:
        # One rank builds what is missing (the built-in corpus, tokenized Hugging Face datasets)
        # while the others wait, and tells them if it failed, so they stop with its message
        # instead of waiting forever; then every rank opens the data itself, so a bad path fails
        # on all ranks at once instead of hanging the rest.
        cache_dir = self.run_dir / "data_cache"
        self._on_main(
            lambda: ensure_local_data(self.cfg.data, cache_dir), what="prepare the training data"
        )
        sources = open_training_data(
            self.cfg.data,
            seq_len=self.cfg.train.seq_len,
            model_vocab_size=self.cfg.model.vocab_size,
            seed=self.cfg.train.seed,
            cache_dir=cache_dir,
        )
        eval_data = None
        if self.cfg.eval.interval:
            eval_data = open_eval_data(
                self.cfg.eval.path,
                self.cfg.data,
                seq_len=self.cfg.train.seq_len,
                model_vocab_size=self.cfg.model.vocab_size,
                tokenizer_path=training_tokenizer(self.cfg.data, sources),
            )
        return sources, eval_data

    def _on_main(self, action, *, what: str) -> None:
        """Run `action` on rank 0 while the others wait; if it fails, every rank stops with its
        message instead of waiting forever."""
        failure = None
        if self.parallel.is_main:
            try:
                action()
            except Exception as error:
                failure = error
        if self.parallel.world_size > 1:
            message = [str(failure) if failure is not None else None]
            dist.broadcast_object_list(message, src=0)
            if message[0] is not None and failure is None:
                raise KilnError(f"rank 0 could not {what}: {message[0]}")
        if failure is not None:
            raise failure

    def save(self) -> Path:
        """Checkpoint this step (in the background with checkpoint.async_mode = "async")."""
        return self.saver.save(
            self.step,
            model=self.model_parts,
            optimizer=self.optimizers,
            config=self.cfg,
            train_state={
                **self.loader.state_dict(),
                "tokens_seen": self.tokens_seen,
                "fingerprint": self.fingerprint(),
            },
            tokenizer_path=self.tokenizer_path(),
        )

    def fingerprint(self) -> dict:
        return run_fingerprint(self.cfg, global_batch=self.loader.global_batch)

    def tokenizer_path(self) -> Path | None:
        """The tokenizer the data was made with, saved beside each checkpoint for export."""
        return training_tokenizer(self.cfg.data, self.sources)

    def _check_checkpoint_sources(self) -> None:
        """Before anything is built: what to load exists, and checkpoints can be written."""
        if self.cfg.checkpoint.load_path:
            resolve_checkpoint(self.cfg.checkpoint.load_path)
        if (
            self.cfg.checkpoint.resume == "never"
            and latest_complete(self.checkpoint_dir) is not None
        ):
            raise ConfigError(
                f"checkpoint.resume = 'never' but {self.checkpoint_dir} already holds checkpoints of "
                "another run; choose a new metrics.run_dir (or checkpoint.dir), or delete that folder"
            )

    def _resume(self) -> None:
        newest = self._resume_point() if self.cfg.checkpoint.resume != "never" else None
        if newest is not None:
            self._check_fingerprint(newest)
            state = load_checkpoint(
                newest, model=self.model_parts, optimizer=self.optimizers, restore_rng=True
            )
            self._continue_from(state)
            if self.parallel.is_main:
                print(f"kiln: resumed from {newest} (step {self.step})", flush=True)
        elif self.cfg.checkpoint.load_path and self.cfg.checkpoint.model_only:
            load_checkpoint(self.cfg.checkpoint.load_path, model=self.model_parts)
            if self.parallel.is_main:
                print(f"kiln: initial weights from {self.cfg.checkpoint.load_path}", flush=True)
        elif self.cfg.checkpoint.load_path:
            state = load_checkpoint(
                self.cfg.checkpoint.load_path,
                model=self.model_parts,
                optimizer=self.optimizers,
                restore_rng=True,
            )
            self._continue_from(state)
            if self.parallel.is_main:
                print(
                    f"kiln: continuing {self.cfg.checkpoint.load_path} (step {self.step}) in "
                    f"{self.checkpoint_dir}",
                    flush=True,
                )

    def _continue_from(self, state: dict) -> None:
        self.step, self.tokens_seen = state["step"], state.get("tokens_seen", 0)
        self.loader.load_state_dict(state)

    def _resume_point(self) -> Path | None:
        """The newest intact checkpoint, chosen on rank 0 (which warns about the ones it skips)
        and the same on every rank."""
        choice: list = [None, None]
        if self.parallel.is_main:
            newest, skipped = resume_candidates(self.checkpoint_dir)
            for message in skipped:
                warn(message)
            if newest is None and complete_steps(self.checkpoint_dir):
                choice[1] = (
                    f"{self.checkpoint_dir} holds checkpoints but none is intact; move them "
                    "away to start over, or fix them"
                )
            choice[0] = str(newest) if newest is not None else None
        if self.parallel.world_size > 1:
            dist.broadcast_object_list(choice, src=0)
        if choice[1] is not None:
            raise KilnError(choice[1])
        return Path(choice[0]) if choice[0] is not None else None

    def _check_fingerprint(self, checkpoint: Path) -> None:
        saved = read_train_state(checkpoint).get("fingerprint")
        changes = fingerprint_changes(saved, self.fingerprint()) if saved is not None else []
        if not changes:
            return
        listing = "; ".join(changes)
        if self.cfg.checkpoint.resume != "force":
            raise ConfigError(
                f"{checkpoint} was written by a run with different settings ({listing}). "
                "Resuming would mix two runs: use a new metrics.run_dir (or checkpoint.dir), or "
                "pass --checkpoint.resume=force to continue with the new settings anyway"
            )
        if self.parallel.is_main:
            warn(f"checkpoint.resume = 'force': continuing {checkpoint} with changes: {listing}")

    def _autocast_context(self):
        if self.cfg.train.mixed_precision == "bf16" and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        if self.cfg.train.mixed_precision == "bf16" and self.parallel.is_main:
            warn("mixed_precision = 'bf16' applies on GPU; training in fp32 on CPU")
        return contextlib.nullcontext()

    def _record(self, result: StepResult, window: _Window) -> dict:
        """The log record of this step; the window's mean syncs with the device first, so the
        elapsed time is honest."""
        loss_avg = window.mean_loss()
        tokens_per_sec = window.tokens_per_sec()
        peak_mem = (
            torch.cuda.max_memory_allocated(self.device) / 1e9
            if self.device.type == "cuda"
            else None
        )
        record = {
            "step": self.step,
            "loss": result.loss.item(),
            "loss_avg": loss_avg,
            "grad_norm": result.grad_norm.item(),
            "lr": result.lr,
            "tokens_seen": self.tokens_seen,
            "tokens_per_sec": tokens_per_sec,
            "mfu": mfu(
                flops_per_token=self.flops_per_token,
                tokens_per_sec=tokens_per_sec,
                peak=self.peak_flops,
                num_devices=self.parallel.world_size,
            ),
            "peak_mem_gb": peak_mem,
            "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
            "skipped_steps": self.nan_guard.skipped_total,
        }
        if result.param_grad_norms is not None:
            record["param_grad_norms"] = result.param_grad_norms
        if self.dataset_losses is not None:
            record |= self.dataset_losses.reduce(
                data_group=self.parallel.data_group(), pipeline_group=self.pipeline_group
            )
        return record


class StepResult(NamedTuple):
    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    tokens: int
    finite: bool  # False: the update was skipped
    stop: bool  # some rank was asked to stop (SIGTERM/SIGUSR1)
    param_grad_norms: dict[str, float] | None = None  # metrics.param_grad_norms


class _Window:
    """Loss and throughput accumulated between two log lines, kept on the device until logged."""

    def __init__(self):
        self.start, self.tokens, self.steps, self.loss_sum = time.perf_counter(), 0, 0, 0.0

    def add(self, loss: torch.Tensor, tokens: int) -> None:
        self.loss_sum = self.loss_sum + loss.detach()
        self.tokens += tokens
        self.steps += 1

    def mean_loss(self) -> float:
        return float(self.loss_sum) / self.steps

    def tokens_per_sec(self) -> float:
        return self.tokens / (time.perf_counter() - self.start)


def _sum_over(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None:
        return value
    value = value.clone()
    dist.all_reduce(value, group=group)
    return value


def _full(value: torch.Tensor) -> torch.Tensor:
    """A loss computed from vocabulary-sharded logits is a DTensor; the plain number is wanted."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _check_writable(directory: Path) -> None:
    """Fail at start-up, not at the first save hours later; leave no folder behind."""
    created = [path for path in (directory, *directory.parents) if not path.exists()]
    probe = directory / ".write_test"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
        for path in created:
            path.rmdir()
    except OSError as error:
        raise KilnError(
            f"checkpoint directory {directory} is not writable ({error.strerror or error}); "
            "set checkpoint.dir to a writable folder"
        ) from None


def _is_collective_failure(error: RuntimeError) -> bool:
    text = str(error).lower()
    return isinstance(error, dist.DistError) or any(
        word in text for word in ("gloo", "nccl", "connection closed", "timed out", "socket")
    )


def latest_step(checkpoint_dir: Path) -> int | None:
    newest = latest_complete(checkpoint_dir)
    return int(newest.name.split("_")[1]) if newest is not None else None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but no GPU is visible; use 'auto' or 'cpu'")
    return torch.device(name)
