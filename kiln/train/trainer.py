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
from kiln.checkpoint.peer_state import check_same_run, load_local_state, peer_state
from kiln.config import JobConfig, validate, write_config
from kiln.config.validate_fault_tolerance import job_world_size
from kiln.data.loader import BatchLoader
from kiln.data.sources import training_tokenizer
from kiln.errors import KilnError
from kiln.events import EventLog
from kiln.metrics.layout_report import startup_summary
from kiln.metrics.plot import redraw_loss_curve
from kiln.metrics.profiler import StepProfiler
from kiln.metrics.step_records import StepLog, run_summary
from kiln.parallel.agree import gather_from_all
from kiln.parallel.apply import build_parallel_model
from kiln.parallel.collectives import collective_failure, is_collective_failure
from kiln.parallel.device import pick_device
from kiln.parallel.diloco import diloco_sync
from kiln.parallel.mesh import init_training_parallel
from kiln.parallel.replica_groups import group_run_config, join_replica_groups
from kiln.resilience import NanGuard, PreemptionFlag, StepWatchdog, flight_recorder, health
from kiln.resilience.time_limit import TimeLimit
from kiln.train.non_finite import report_skipped, roll_back, skip_action
from kiln.train.optimizer import build_optimizers
from kiln.train.preflight import check_stop_at_step
from kiln.train.run_data import open_run_data
from kiln.train.run_end import RunEnd
from kiln.train.schedule_free import optimizer_eval_point, optimizer_train_point
from kiln.train.step import StepFlags, StepResult, TrainStep
from kiln.train.task_eval import TaskEval


class Trainer:
    def __init__(self, cfg: JobConfig, *, world_size: int | None = None):
        validate(cfg, world_size or job_world_size(cfg, int(os.environ.get("WORLD_SIZE", "1"))))
        cfg = group_run_config(cfg)  # fault tolerance: each replica group logs on its own
        self.cfg, self.run_dir = cfg, Path(cfg.metrics.run_dir)
        device = pick_device(cfg.train.device)
        flight_recorder.prepare(self.run_dir, device)  # before the process group: NCCL's settings
        self.parallel = init_training_parallel(cfg, device)
        self.device = self.parallel.device
        self.events = EventLog(self.run_dir, enabled=self.parallel.is_main)
        health.preflight(cfg, self.parallel.mesh, self.device, events=self.events)
        self.checkpoints = CheckpointManager(cfg, device=self.device, events=self.events)
        self.checkpoints.check_sources()  # before anything is built or written
        self.checkpoints.open_for_writing(collective_timeout_s=cfg.resilience.collective_timeout_s)
        self.sources, self.eval_data = open_run_data(cfg, self.parallel)
        data_ranks = self.parallel.data_ranks
        self.global_batch = cfg.train.batch_size * cfg.train.grad_accum_steps * data_ranks
        start = self.checkpoints.start_point(self.fingerprint())
        check_stop_at_step(cfg, start.step)
        torch.manual_seed(cfg.train.seed)
        # The whole model (or this rank's pipeline stages); weights a checkpoint loads are not drawn.
        seed = None if start.loads_weights else cfg.train.seed
        self.model_parts = build_parallel_model(cfg, self.parallel, seed=seed)
        self.optimizers = build_optimizers(self.model_parts, cfg, device=self.device)
        self.replicas = join_replica_groups(
            cfg, self.parallel, self._peer_state, self._load_peer_state, events=self.events
        )
        self.diloco = diloco_sync(cfg, self.replicas, self.model_parts)
        self.step_fn = TrainStep(
            cfg,
            self.parallel,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            sources=self.sources,
            replicas=None if self.diloco else self.replicas,  # DiLoCo: each group on its own
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
        self.nan_guard = NanGuard.from_config(cfg.resilience)
        self._restore(start) if self.replicas is None or self.diloco else self._join(start)
        # Only a run that could start records its config: a failed attempt leaves the run dir as it was.
        if self.parallel.is_main:
            write_config(cfg, self.run_dir / "config.toml")
            world = self.parallel.job_world_size
            peer = self.replicas.peer_start() if self.replicas is not None else None
            at = {"peer_start": peer, "device": self.device}  # the device picks a family's kernels
            print(startup_summary(cfg, world, start.path, start.step, **at), flush=True)
        main, max_steps = self.parallel.is_main, cfg.train.max_steps
        self.end = RunEnd(
            self.checkpoints, self.events, save=self.save, max_steps=max_steps, is_main=main
        )
        self.time_limit = TimeLimit(cfg.train.time_limit_minutes, enabled=main)
        self.iteration_seconds: deque[float] = deque(maxlen=20)

    def train(self) -> list[dict]:
        """Run to train.max_steps (or stop_at_step, time_limit_minutes), checkpoint, return the
        logged records; raises Preempted after a checkpoint when a rank was signalled."""
        preemption = PreemptionFlag()
        watchdog = StepWatchdog(self.cfg.resilience.step_timeout_s, rank=self.parallel.rank)
        main, world = self.parallel.is_main, self.parallel.job_world_size
        log = StepLog.opened(
            self.cfg, start_step=self.step, is_main=main, num_devices=world, device=self.device
        )
        profiler = StepProfiler(self.cfg, rank=self.parallel.rank, device=self.device)
        try:
            records = self._loop(preemption, watchdog, log, profiler)
        except RuntimeError as error:
            if not is_collective_failure(error):
                raise
            flight_recorder.dump(f"a collective failed in step {self.step + 1}")
            self.checkpoints.commit_finished_save(after_step=self.step)  # before naming the newest
            newest = self.checkpoints.newest()
            raise collective_failure(error, self.parallel.rank, self.step + 1, newest) from None
        finally:
            self.checkpoints.commit_finished_save(after_step=self.step)  # none in flight: no-op
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
        self, preemption: PreemptionFlag, watchdog: StepWatchdog, log: StepLog, prof: StepProfiler
    ) -> list[dict]:
        cfg = self.cfg.train
        last_step = min(cfg.stop_at_step or cfg.max_steps, cfg.max_steps)
        records, first_step = [], self.step + 1
        while self.step < last_step:
            began = time.perf_counter()
            if self.step + 1 > first_step:  # the first step compiles and warms up: no bound on it
                watchdog.arm(self.step + 1)
            prof.before_step(self.step + 1)
            # train.time_limit_minutes, decided on rank 0 (the flag is agreed in the step).
            time_up = self.time_limit.expiring(
                step_seconds=max(self.iteration_seconds, default=0.0),
                save_seconds=self.checkpoints.stop_save_seconds,
            )
            result = self.train_step(
                stop_requested=preemption.received is not None, time_up=time_up
            )
            watchdog.disarm()
            if not result.committed:
                continue  # nothing trained: the next batch redoes the step
            log.add(result.loss, result.tokens)
            if log.due(self.step):
                records.append(self._log(result, log))
            action = skip_action(self.nan_guard, result, after=self.cfg.resilience.nan_action)
            if action != "ok" and self._skipped_step(action, result, log):
                continue  # rolled back: nothing of this step to checkpoint
            if result.save_written:  # a save in flight at the step's start is written everywhere
                log.excluding(lambda: self.checkpoints.finish_save(after_step=self.step))
            if self.cfg.checkpoint.interval and self.step % self.cfg.checkpoint.interval == 0:
                log.excluding(self.save)  # saving is not training time; async returns once staged
            prof.after_step(self.step)  # the step's checkpoint is in its trace
            self.iteration_seconds.append(time.perf_counter() - began)
            if result.stop:
                raise self.end.preempted(self.step, preemption.received)
            if result.time_up:
                self.end.with_checkpoint(self.step, "train.time_limit_minutes", "again to continue")
                return records
        if cfg.stop_at_step == self.step < cfg.max_steps:
            self.end.with_checkpoint(self.step, "train.stop_at_step", "without it to continue")
            return records
        if self.cfg.checkpoint.save_final and not self.checkpoints.is_saved(self.step):
            self.save()
        self.end.close(self.step, "train.max_steps")
        return records

    def train_step(self, *, stop_requested: bool = False, time_up: bool = False) -> StepResult:
        """One optimizer step; skipped (no update) when any rank saw a non-finite loss or
        gradient norm. The flags of the result are agreed by all ranks."""
        pending = not self.checkpoints.written_locally()
        flags = StepFlags(stop=stop_requested, time_up=time_up, save_pending=pending)
        if self.replicas is not None and self.diloco is None and not self.replicas.in_quorum:
            self.replicas.start_step(self.step + 1)
        with record_function("data"):
            batch = self.loader.next_step()
        result = self.step_fn(batch, step=self.step + 1, flags=flags)
        if result.committed:  # a step a peer failed in is not counted; its samples are skipped
            self.step += 1
            self.tokens_seen += result.tokens
            if self.diloco is not None:
                self.diloco.after_step(self.step)
        return result

    def _restore(self, start: StartPoint) -> None:
        outer = self.diloco.resume_tensors(start.train_state) if self.diloco else None
        parts = {"model": self.model_parts, "optimizer": self.optimizers}
        state = self.checkpoints.restore(start, **parts, extra=outer)
        if self.diloco is not None:  # its syncs, or synchronized: the weights loaded (or drawn)
            self.diloco.restored(state if outer is not None else None)
        if state is not None:
            self._continue_from(state)
        optimizer_train_point(self.optimizers)  # a checkpoint holds Schedule-Free's eval point

    def _join(self, start: StartPoint) -> None:
        """Fault tolerance: the first step's quorum. A group behind a live peer takes its
        state there (no checkpoint read); one that is not starts from `start`."""
        if not self.replicas.start_step(self.step + 1).healed:
            self._restore(start)
            self.replicas.set_step(self.step)

    def _continue_from(self, state: dict) -> None:
        self.step, self.tokens_seen = state["step"], state.get("tokens_seen", 0)
        self.loader.load_state_dict(state)
        self.step_fn.load_state_dict(state)

    def _peer_state(self) -> dict:
        """What a live group sends a rejoining one, at a step boundary."""
        guard = {"nan_guard": (self.nan_guard.consecutive, self.nan_guard.skipped_total)}
        train = self._train_state() | {"step": self.step} | guard
        return peer_state(train, self.parallel.degrees, self.model_parts, self.optimizers)

    def _load_peer_state(self, state: dict) -> None:
        own = {"train": {"fingerprint": self.fingerprint()}, "layout": self.parallel.degrees}
        check_same_run(self.parallel.replica_group, peer=state, own=own)
        load_local_state(self.model_parts, self.optimizers, state["parts"])
        self.nan_guard.consecutive, self.nan_guard.skipped_total = state["train"]["nan_guard"]
        self._continue_from(state["train"])

    def _log(self, result: StepResult, log: StepLog) -> dict:
        loss, grad_norm, lr = result.loss, result.grad_norm, result.lr
        record = log.record(
            step=self.step, loss=loss, grad_norm=grad_norm, lr=lr, tokens_seen=self.tokens_seen
        )
        record["skipped_steps"] = self.nan_guard.skipped_total
        if result.param_grad_norms is not None:
            record["param_grad_norms"] = result.param_grad_norms.read()
        record |= self.step_fn.records()
        if log.eval_due(self.step):
            log.excluding(lambda: record.update(self.evaluate()))  # not training time
        if self.parallel.is_main:
            log.logger.log(record)
        return record

    def _skipped_step(self, action: str, result: StepResult, log: StepLog) -> bool:
        """The update of this step was skipped (not finite, or a spike); after too many in a row
        (`action` 'stop' or 'rollback'), stop or roll back (then return True)."""
        guard, spikes, main = self.nan_guard, self.step_fn.spikes, self.parallel.is_main
        said = {"step": self.step, "events": self.events, "is_main": main}
        counted = report_skipped(guard, spikes, result, **said)
        if action == "stop":
            self.end.close(self.step, "resilience.nan_action")
            raise KilnError(counted.stop_message(self.step, newest=self.checkpoints.newest()))
        if action == "rollback":
            parts = {"model": self.model_parts, "optimizer": self.optimizers, "spikes": spikes}
            state = roll_back(self.checkpoints, guard, at_step=self.step, is_main=main, **parts)
            self.step, self.tokens_seen = state["step"], state["tokens_seen"]
            log.rolled_back_to(self.step)
        return action == "rollback"

    def evaluate(self) -> dict[str, float]:
        with optimizer_eval_point(self.optimizers):
            return self.tasks.at(self.step, held_out=self.step_fn.evaluate, data=self.eval_data)

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
                train_state=self._train_state(),
                tokenizer_path=training_tokenizer(self.cfg.data, self.sources),
                extra=self.diloco.checkpoint_tensors() if self.diloco is not None else None,
            )
        if self.parallel.is_main:  # a preempted run has its plot too
            redraw_loss_curve(self.cfg)

    def _train_state(self) -> dict:
        """Where the run is: the data position, the tokens trained on, the run's settings."""
        data = self.loader.state_dict() | self.step_fn.state_dict()
        data |= self.diloco.train_state() if self.diloco is not None else {}
        return data | {"tokens_seen": self.tokens_seen, "fingerprint": self.fingerprint()}

    def fingerprint(self) -> dict:
        return run_fingerprint(self.cfg, global_batch=self.global_batch)
