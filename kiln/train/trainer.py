"""The training loop. Reads like the recipe: mesh → model on meta → parallelize → materialize/load →
optimizer, schedule, data → loop (fetch, forward/backward per micro-batch, clip, step, log, checkpoint)."""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path

import torch
from torch.profiler import record_function

from kiln.checkpoint.fingerprint import run_fingerprint
from kiln.checkpoint.manager import CheckpointManager, StartPoint
from kiln.checkpoint.peer_state import check_same_run, load_local_state, local_state
from kiln.config import JobConfig, validate, write_config
from kiln.config.validate_fault_tolerance import job_world_size
from kiln.data.loader import BatchLoader
from kiln.data.sources import ensure_local_data, open_data, training_tokenizer
from kiln.errors import KilnError, first_line
from kiln.events import EventLog
from kiln.log import warn
from kiln.metrics.backends import open_backends
from kiln.metrics.layout_report import startup_summary
from kiln.metrics.plot import redraw_loss_curve
from kiln.metrics.profiler import StepProfiler
from kiln.metrics.step_records import StepLog, run_summary
from kiln.model import build_model, materialize
from kiln.parallel.agree import decide_on_main, gather_from_all
from kiln.parallel.apply import apply_parallelism
from kiln.parallel.collectives import is_collective_failure
from kiln.parallel.device import pick_device
from kiln.parallel.mesh import init_parallel
from kiln.parallel.replica_groups import group_run_config, join_replica_groups
from kiln.resilience import NanGuard, PreemptionFlag, StepWatchdog
from kiln.resilience.preemption import Preempted
from kiln.resilience.time_limit import TimeLimit
from kiln.train.optimizer import build_optimizers
from kiln.train.preflight import check_stop_at_step
from kiln.train.schedule_free import optimizer_eval_point, optimizer_train_point
from kiln.train.step import StepFlags, StepResult, TrainStep
from kiln.train.task_eval import TaskEval


class Trainer:
    def __init__(self, cfg: JobConfig, *, world_size: int | None = None):
        validate(cfg, world_size or job_world_size(cfg, int(os.environ.get("WORLD_SIZE", "1"))))
        cfg = group_run_config(cfg)  # fault tolerance: each replica group logs on its own
        self.cfg, self.run_dir = cfg, Path(cfg.metrics.run_dir)
        device = pick_device(cfg.train.device)
        self.parallel = init_parallel(
            cfg.distributed,
            device,
            timeout_s=cfg.resilience.collective_timeout_s,
            replica_group=cfg.fault_tolerance.replica_group
            if cfg.fault_tolerance.enabled
            else None,
        )
        self.device = self.parallel.device
        self.events = EventLog(self.run_dir, enabled=self.parallel.is_main)
        self.checkpoints = CheckpointManager(cfg, device=self.device, events=self.events)
        self.checkpoints.check_sources()  # before anything is built or written
        self.checkpoints.open_for_writing()
        self.sources, self.eval_data = self._open_data()
        data_ranks = self.parallel.data_ranks
        self.global_batch = cfg.train.batch_size * cfg.train.grad_accum_steps * data_ranks
        start = self.checkpoints.start_point(self.fingerprint())
        check_stop_at_step(cfg, start.step)
        torch.manual_seed(cfg.train.seed)
        # The whole model (or this rank's pipeline stages); weights a checkpoint loads are not drawn.
        self.model_parts = apply_parallelism(build_model(cfg.model), cfg, self.parallel)
        seed = None if start.loads_weights else cfg.train.seed
        for part in self.model_parts:
            materialize(part, device=self.device, seed=seed)
        self.optimizers = build_optimizers(self.model_parts, cfg, device=self.device)
        self.replicas = join_replica_groups(
            cfg,
            self.parallel,
            state_fn=self._peer_state,
            load_fn=self._load_peer_state,
            events=self.events,
        )
        self.step_fn = TrainStep(
            cfg,
            self.parallel,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            sources=self.sources,
            replicas=self.replicas,
        )
        self.tasks = TaskEval(cfg, self.parallel, self.model_parts, sources=self.sources)
        self.loader = BatchLoader.for_training(
            self.sources,
            cfg,
            data_ranks=data_ranks,
            data_rank=self.parallel.data_rank,
            pin=self.device.type == "cuda",
            gather=gather_from_all,
        )
        self.step, self.tokens_seen = 0, 0
        if start.train_state is not None:  # before any weight is read
            self.loader.check_order(start.train_state)
        # Fault tolerance: the first step's quorum tells whether a live group sends the state.
        self.start = start if self.replicas is not None else None
        if self.replicas is None:
            self._restore(start)
        self.nan_guard = NanGuard.from_config(cfg.resilience)
        # Only a run that could start records its config: a failed attempt leaves the run dir as it was.
        if self.parallel.is_main:
            write_config(cfg, self.run_dir / "config.toml")
            print(
                startup_summary(cfg, self.parallel.world_size, start.path, start.step), flush=True
            )
        self.time_limit = TimeLimit(cfg.train.time_limit_minutes, enabled=self.parallel.is_main)
        self.iteration_seconds: deque[float] = deque(maxlen=20)

    def train(self) -> list[dict]:
        """Run to train.max_steps (or train.stop_at_step, or train.time_limit_minutes) with a
        checkpoint at the end; return the logged records. Raises Preempted, after a checkpoint,
        when a rank was signalled (SIGTERM/SIGUSR1/SIGINT)."""
        preemption = PreemptionFlag()
        watchdog = StepWatchdog(self.cfg.resilience.step_timeout_s, rank=self.parallel.rank)
        log, main = self._step_log(), self.parallel.is_main
        profiler = StepProfiler(self.cfg, rank=self.parallel.rank, device=self.device)
        try:
            records = self._loop(preemption, watchdog, log, profiler)
        except RuntimeError as error:
            if not is_collective_failure(error):
                raise
            raise KilnError(
                f"rank {self.parallel.rank}: a collective failed during step {self.step + 1}: "
                f"{first_line(error)}. Another rank most likely died or hung (its log names "
                f"why); the job resumes from {self.checkpoints.newest() or 'scratch'} when restarted"
            ) from None
        finally:
            if self.replicas is not None:
                self.replicas.close()
            watchdog.close()
            preemption.restore()
            profiler.close()
            log.close()
        if main:
            print(run_summary(self.cfg, step=self.step, checkpoint=self.checkpoints.newest()))
        return records

    def _loop(
        self,
        preemption: PreemptionFlag,
        watchdog: StepWatchdog,
        log: StepLog,
        profiler: StepProfiler,
    ) -> list[dict]:
        cfg = self.cfg.train
        last_step = min(cfg.stop_at_step or cfg.max_steps, cfg.max_steps)
        records, first_step = [], self.step + 1
        while self.step < last_step:
            began = time.perf_counter()
            if self.step + 1 > first_step:  # the first step compiles and warms up: no bound on it
                watchdog.arm(self.step + 1)
            profiler.before_step(self.step + 1)
            result = self.train_step(
                stop_requested=preemption.received is not None, time_up=self._time_up()
            )
            watchdog.disarm()
            if not result.committed:
                continue  # nothing trained: the next batch redoes the step
            log.add(result.loss, result.tokens)
            if log.due(self.step):
                records.append(self._log(result, log))
            action = self.nan_guard.update(finite=result.finite)
            if action != "ok" and self._non_finite_step(action, result, log):
                continue  # rolled back: nothing of this step to checkpoint
            if result.save_written:  # a save in flight at the step's start is written everywhere
                log.excluding(lambda: self.checkpoints.finish_save(after_step=self.step))
            if self.cfg.checkpoint.interval and self.step % self.cfg.checkpoint.interval == 0:
                log.excluding(self.save)  # saving is not training time; async returns once staged
            profiler.after_step(self.step)  # the step's checkpoint is in its trace
            self.iteration_seconds.append(time.perf_counter() - began)
            if result.stop or result.time_up:
                return self._stop_early(result, preemption, records)
        if cfg.stop_at_step == self.step < cfg.max_steps:
            self._end_with_checkpoint("train.stop_at_step", "without it to continue")
        elif self.cfg.checkpoint.save_final and not self.checkpoints.is_saved(self.step):
            self.save()
        self._close("train.stop_at_step" if self.step < cfg.max_steps else "train.max_steps")
        return records

    def train_step(self, *, stop_requested: bool = False, time_up: bool = False) -> StepResult:
        """One optimizer step; skipped (no update) when any rank saw a non-finite loss or
        gradient norm. The flags of the result are agreed by all ranks."""
        pending = not self.checkpoints.written_locally()
        flags = StepFlags(stop=stop_requested, time_up=time_up, save_pending=pending)
        if self.replicas is not None:
            self._quorum()
        with record_function("data"):
            batch = self.loader.next_step()
        result = self.step_fn(batch, step=self.step + 1, flags=flags)
        if result.committed:  # a step a peer failed in is not counted; its samples are skipped
            self.step += 1
            self.tokens_seen += result.tokens
        return result

    def _quorum(self) -> None:
        """Fault tolerance: join this step's quorum. At the first step a group that a live peer
        did not bring up to date starts from the checkpoint (or scratch) instead."""
        quorum = self.replicas.start_step(self.step + 1)
        if self.start is not None and not quorum.healed:
            self._restore(self.start)
        self.start = None
        self.replicas.set_step(self.step)

    def _restore(self, start: StartPoint) -> None:
        state = self.checkpoints.restore(start, model=self.model_parts, optimizer=self.optimizers)
        if state is not None:
            self.step, self.tokens_seen = state["step"], state.get("tokens_seen", 0)
            self.loader.load_state_dict(state)
        optimizer_train_point(self.optimizers)  # a checkpoint holds Schedule-Free's eval point

    def _peer_state(self) -> dict:
        """What a live group sends a rejoining one (at a step boundary)."""
        train = self.loader.state_dict() | {"step": self.step, "tokens_seen": self.tokens_seen}
        parts = local_state(self.model_parts, self.optimizers)
        same_run = self.fingerprint() | {"layout": self.parallel.degrees}
        return {"fingerprint": same_run, "parts": parts, "train": train}

    def _load_peer_state(self, state: dict) -> None:
        same_run = self.fingerprint() | {"layout": self.parallel.degrees}
        check_same_run(self.parallel.replica_group, peer=state["fingerprint"], own=same_run)
        load_local_state(self.model_parts, self.optimizers, state["parts"])
        self.step, self.tokens_seen = state["train"]["step"], state["train"]["tokens_seen"]
        self.loader.load_state_dict(state["train"])

    def _step_log(self) -> StepLog:
        return StepLog(
            self.cfg,
            start_step=self.step,
            is_main=self.parallel.is_main,
            num_devices=self.parallel.world_size,
            device=self.device,
            backends=open_backends(self.cfg, start_step=self.step) if self.parallel.is_main else (),
        )

    def _time_up(self) -> bool:
        """train.time_limit_minutes, decided on rank 0 (the flag is agreed in the step): stop
        after this step when this one, one more and a checkpoint could not all finish in time."""
        return self.time_limit.expiring(
            step_seconds=max(self.iteration_seconds, default=0.0),
            save_seconds=self.checkpoints.save_seconds,
        )

    def _log(self, result: StepResult, log: StepLog) -> dict:
        record = log.record(
            step=self.step,
            loss=result.loss,
            grad_norm=result.grad_norm,
            lr=result.lr,
            tokens_seen=self.tokens_seen,
        )
        record["skipped_steps"] = self.nan_guard.skipped_total
        if result.param_grad_norms is not None:
            record["param_grad_norms"] = result.param_grad_norms
        record |= self.step_fn.records()
        if log.eval_due(self.step):
            log.excluding(lambda: record.update(self.evaluate()))  # not training time
        if self.parallel.is_main:
            log.logger.log(record)
        return record

    def _non_finite_step(self, action: str, result: StepResult, log: StepLog) -> bool:
        """The update of this step was skipped; after too many in a row (`action` 'stop' or
        'rollback'), stop or roll back (then return True)."""
        guard, loss, grad_norm = self.nan_guard, result.loss.item(), result.grad_norm.item()
        if self.parallel.is_main:
            warn(guard.skipped_message(self.step, loss=loss, grad_norm=grad_norm))
        self.events.write("nan_skip", step=self.step, loss=str(loss), grad_norm=str(grad_norm))
        if action == "stop":
            self._close("resilience.nan_action")
            raise KilnError(guard.stop_message(self.step, newest=self.checkpoints.newest()))
        if action == "rollback":
            bad_step, parts = self.step, {"model": self.model_parts, "optimizer": self.optimizers}
            state = self.checkpoints.rollback(at_step=bad_step, **parts)
            optimizer_train_point(self.optimizers)
            self.step, self.tokens_seen = state["step"], state["tokens_seen"]
            guard.reset()
            if self.parallel.is_main:
                warn(f"rolled back from step {bad_step} to {state['path']}; the data continues")
            log.rolled_back_to(self.step)
        return action == "rollback"

    def _stop_early(self, result: StepResult, preemption: PreemptionFlag, records: list) -> list:
        if not result.stop:
            self._end_with_checkpoint("train.time_limit_minutes", "again to continue")
            self._close("train.time_limit_minutes")
            return records
        if not self.checkpoints.is_saved(self.step):
            self.save()
        signal_name = preemption.received or "a signal on another rank"
        self._close(f"signal: {signal_name}")
        raise Preempted(
            signal_name=signal_name, step=self.step, checkpoint=self.checkpoints.newest()
        )

    def _close(self, reason: str) -> None:
        """Commit the save in flight, then record why and where the run stops."""
        self.checkpoints.close(after_step=self.step)
        self.events.write("stop", step=self.step, reason=reason)

    def _end_with_checkpoint(self, reason: str, how: str) -> None:
        if not self.checkpoints.is_saved(self.step):
            self.save()
        if self.parallel.is_main:
            warn(
                f"stopped after step {self.step} of {self.cfg.train.max_steps} ({reason}); run "
                f"the same command {how} from {self.checkpoints.dir}"
            )

    def evaluate(self) -> dict[str, float]:
        with optimizer_eval_point(self.optimizers):
            return self.tasks.at(self.step, held_out=self.step_fn.evaluate, data=self.eval_data)

    def _open_data(self):
        # Rank 0 builds what is missing (demo corpus, tokenized HF datasets); then all open it.
        cache_dir = self.run_dir / "data_cache"
        decide_on_main(
            lambda: ensure_local_data(self.cfg.data, cache_dir), what="prepare the training data"
        )
        ranks = {"data_rank": self.parallel.data_rank, "data_ranks": self.parallel.data_ranks}
        return open_data(self.cfg, cache_dir=cache_dir, **ranks)

    def save(self) -> None:
        """Checkpoint this step (in the background with checkpoint.async_mode = "async"), with
        Schedule-Free's weights at their evaluation point (an async save has copied them)."""
        if self.replicas is not None and not self.replicas.writes_checkpoints():
            return  # another replica group writes the run's checkpoints
        with optimizer_eval_point(self.optimizers), record_function("checkpoint"):
            self.checkpoints.save(
                self.step,
                model=self.model_parts,
                optimizer=self.optimizers,
                config=self.cfg,
                train_state={
                    **self.loader.state_dict(),
                    "tokens_seen": self.tokens_seen,
                    "fingerprint": self.fingerprint(),
                },
                tokenizer_path=training_tokenizer(self.cfg.data, self.sources),
            )
        if self.parallel.is_main:  # a preempted run has its plot too
            redraw_loss_curve(self.cfg)

    def fingerprint(self) -> dict:
        return run_fingerprint(self.cfg, global_batch=self.global_batch)
