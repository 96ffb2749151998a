"""The run's checkpoint state, decided once: where to start (resume, warm start or scratch), the
config fingerprint, saving (sync or async), when a background save is finished, rollback, and the
last saved step.

Whatever depends on the checkpoint store (a filesystem or an object store) or on a background save is decided on rank 0 and agreed
(`kiln.parallel.agree`); the last saved step lives in memory, the same on every rank. A rank that
read `latest` from disk while rank 0 was still committing could otherwise decide to save when
rank 0 does not, and the two would wait for each other in a collective until the timeout.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from kiln.checkpoint.checkpointer import load_checkpoint, read_model_config, read_train_state
from kiln.checkpoint.fingerprint import fingerprint_changes
from kiln.checkpoint.hf_export import HfExporter, check_exportable
from kiln.checkpoint.layout import (
    Skipped,
    complete_steps,
    latest_complete,
    resolve_checkpoint,
    resume_candidates,
)
from kiln.checkpoint.lease import Lease, owner_of, run_identity
from kiln.checkpoint.saver import CheckpointSaver, SaveRecord
from kiln.checkpoint.shared_dir import check_one_filesystem
from kiln.checkpoint.state import Modules, Optimizers
from kiln.checkpoint.store import Location, location, store_for
from kiln.config import JobConfig, ModelConfig, MoEConfig
from kiln.config.load import moved_key
from kiln.errors import ConfigError, KilnError
from kiln.events import EventLog
from kiln.log import info, warn
from kiln.parallel.agree import decide_on_main, is_main


class StartKind(enum.StrEnum):
    """How an invocation starts. The value is what events.jsonl's "resume" event and the
    pre-flight report write."""

    RESUME = "resume"  # this run's newest intact checkpoint: weights, optimizer, data position
    CONTINUE = "continue"  # checkpoint.load_path with model_only = false: all of its state
    WARM_START = "warm start"  # checkpoint.load_path's weights only
    SCRATCH = "scratch"


@dataclass(frozen=True)
class StartPoint:
    """How this invocation starts: `kind`, from `path` (None: scratch)."""

    kind: StartKind
    path: Location | None = None
    step: int = 0
    train_state: dict | None = None  # what a resume continues: data position, tokens seen
    skipped: tuple[Skipped, ...] = ()  # newer checkpoints passed over, and why

    @property
    def loads_weights(self) -> bool:
        """A checkpoint overwrites every weight: random init would be wasted work."""
        return self.path is not None


class CheckpointManager:
    """The run's checkpoints, the same on every rank; each commit, resume and skipped
    checkpoint recorded in `events` (rank 0's log)."""

    def __init__(self, cfg: JobConfig, *, device: torch.device, events: EventLog):
        self.cfg, self.model, self.train = cfg.checkpoint, cfg.model, cfg.train
        self.events = events
        # Stopping early (stop_at_step, a time limit) ends with a checkpoint too.
        self.will_save = bool(
            self.cfg.interval
            or self.cfg.save_final
            or cfg.train.stop_at_step
            or cfg.train.time_limit_minutes
        )
        # A folder, or a URL (s3://bucket/run) kept through fsspec (kiln/checkpoint/store.py).
        self.dir = location(self.cfg.dir or Path(cfg.metrics.run_dir) / "checkpoints")
        self.device = device
        self.saver: CheckpointSaver | None = None
        self.last_saved_step: int | None = None
        self.run_dir = str(Path(cfg.metrics.run_dir).absolute())
        self.fault_tolerant = cfg.fault_tolerance.enabled
        self.lighthouse = cfg.fault_tolerance.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        self.lease: Lease | None = None
        self.export_hf, self.max_steps = self.cfg.export_hf, cfg.train.max_steps
        self.exporter: HfExporter | None = None
        self.last_committed: SaveRecord | None = None  # by this process

    def check_sources(self) -> None:
        """Before anything is built: what to load exists, and no other run's checkpoints are in
        the way."""
        decide_on_main(self._check_sources, what="use the checkpoint settings")

    def _check_sources(self) -> None:
        check_exportable(self.export_hf, self.model, directory=str(self.dir))
        if self.cfg.load_path:
            resolve_checkpoint(self.cfg.load_path)
        if self.cfg.resume == "never" and latest_complete(self.dir) is not None:
            raise ConfigError(
                f"checkpoint.resume = 'never' but {self.dir} already holds checkpoints of "
                "another run; choose a new metrics.run_dir (or checkpoint.dir), or delete that folder"
            )

    def start_point(self, fingerprint: dict[str, Any]) -> StartPoint:
        """Decided on rank 0: the newest intact checkpoint of this run (refused if it was written
        with other settings, unless checkpoint.resume = 'force'), else checkpoint.load_path,
        else scratch. The newest saved step starts as the step resumed from."""
        start = decide_on_main(lambda: self._start_point(fingerprint), what="choose where to start")
        resumed = start.kind is StartKind.RESUME
        self.last_saved_step = start.step if resumed else None
        if self.saver is not None and resumed:
            self.saver.newest = start.path
        return start

    def _start_point(self, fingerprint: dict[str, Any]) -> StartPoint:
        if self.cfg.resume != "never":
            newest, skipped = resume_candidates(self.dir)
            for passed in skipped:
                warn(passed.message())
            if newest is None and complete_steps(self.dir):
                found = "".join(f"\n  - {passed.path}: {passed.reason}" for passed in skipped)
                raise KilnError(
                    f"{self.dir} holds checkpoints but none is intact:{found}\nmove them away "
                    "to start over, or point checkpoint.load_path at a good copy"
                )
            if newest is not None:
                state = read_train_state(newest)
                self._check_fingerprint(newest, state.get("fingerprint"), fingerprint)
                return StartPoint(StartKind.RESUME, newest, state["step"], state, tuple(skipped))
        if self.cfg.load_path:
            path = resolve_checkpoint(self.cfg.load_path)
            _check_same_model(path, self.model)
            if self.cfg.model_only:
                return StartPoint(StartKind.WARM_START, path)
            state = read_train_state(path)
            return StartPoint(StartKind.CONTINUE, path, state["step"], state)
        return StartPoint(StartKind.SCRATCH)

    def _check_fingerprint(self, path: Location, saved: dict | None, current: dict) -> None:
        # An older run recorded the expert count as model.moe.num_experts: the same key.
        experts = {moved_key(k): v for k, v in (saved or {}).items()}.get("model.moe.num_experts")
        if experts is not None:
            # Not even under resume = 'force': the weights cannot load.
            _check_expert_count(path, experts, self.model.moe.num_experts)
        changes = fingerprint_changes(saved, current) if saved is not None else []
        if not changes:
            return
        listing = "; ".join(changes)
        horizon = next((c for c in changes if c.startswith("train.max_steps:")), None)
        why = (
            f" train.max_steps is the horizon of the '{current.get('scheduler.name')}' "
            "learning-rate schedule: a new value reshapes the steps already taken. To end an "
            "invocation early without touching the schedule, use train.stop_at_step or "
            "train.time_limit_minutes."
            if horizon
            else ""
        )
        multiple = next((c for c in changes if c.startswith("train.batch_schedule.multiple_")), 0)
        if multiple and self.train.batch_schedule.multiple_of == 0:
            was = saved["train.batch_schedule.multiple_of"]
            why += (
                f" The batch ramp rounds every step's batch to a multiple of {was} sequences "
                f"(one micro-batch on every data rank of the run that wrote it); pass "
                f"--train.batch_schedule.multiple_of={was} to keep its steps on this layout."
            )
        saved_batch = saved.get("train.global_batch")  # older runs did not record it
        if saved_batch is not None and saved_batch != current["train.global_batch"]:
            why += self._batch_hint(saved_batch, current["train.global_batch"])
        if self.cfg.resume != "force":
            raise ConfigError(
                f"{path} was written by a run with different settings ({listing}).{why} "
                "Resuming would mix two runs: use a new metrics.run_dir (or checkpoint.dir), or "
                "pass --checkpoint.resume=force to continue with the new settings anyway"
            )
        warn(f"checkpoint.resume = 'force': continuing {path} with changes: {listing}")

    def _batch_hint(self, saved: int, current: int) -> str:
        """How to keep the run's global batch on this number of data ranks."""
        accum, batch_size = self.train.grad_accum_steps, self.train.batch_size
        data_ranks = current // (batch_size * accum)
        keep = []
        if saved % (accum * data_ranks) == 0:
            keep.append(f"--train.batch_size={saved // (accum * data_ranks)}")
        if saved % (batch_size * data_ranks) == 0:
            keep.append(f"--train.grad_accum_steps={saved // (batch_size * data_ranks)}")
        how = (
            f"pass {' or '.join(keep)} to keep it"
            if keep
            else "no batch size or accumulation keeps it on this many ranks"
        )
        return (
            f" The global batch is train.batch_size × train.grad_accum_steps × data ranks: "
            f"{saved} sequences in the checkpoint, {batch_size} × {accum} × {data_ranks} = "
            f"{current} here; {how}."
        )

    def restore(
        self,
        start: StartPoint,
        *,
        model: Modules,
        optimizer: Optimizers,
        extra: dict[str, torch.Tensor] | None = None,
    ) -> dict | None:
        """Load what `start` names into the model (and optimizer, RNG, `extra` when resuming);
        return the saved train state to continue from, or None for a warm start or scratch."""
        if start.kind is StartKind.SCRATCH:
            return None
        if start.kind is StartKind.WARM_START:
            load_checkpoint(start.path, model=model)
            _say(f"initial weights from {start.path}")
            return None
        state = load_checkpoint(
            start.path, model=model, optimizer=optimizer, restore_rng=True, extra=extra
        )
        where = "resumed from" if start.kind is StartKind.RESUME else "continuing"
        _say(f"{where} {start.path} (step {state['step']}) in {self.dir}")
        skipped = [{"path": str(s.path), "reason": s.reason} for s in start.skipped]
        self.events.write(
            "resume", step=state["step"], path=start.path, kind=start.kind, skipped=skipped
        )
        return state

    def probe_writable(self) -> None:
        """Fail at start-up, not at the first save hours later, if checkpoints cannot be written."""
        if self.will_save:
            decide_on_main(
                lambda: store_for(self.dir).check_writable(self.dir), what="write checkpoints"
            )

    def open_for_writing(self, *, collective_timeout_s: float) -> None:
        """Before anything is written: the location is writable, one filesystem for every node
        (a local path), and this run's alone (its lease, kiln/checkpoint/lease.py)."""
        self.probe_writable()
        self.saver = CheckpointSaver(
            self.dir,
            keep_last_n=self.cfg.keep_last_n,
            async_mode=self.cfg.async_mode,
            device=self.device,
            timeout_s=collective_timeout_s,
        )
        if self.export_hf != "never" and is_main():
            self.exporter = HfExporter(
                self.dir, keep_last_n=self.cfg.keep_last_n, events=self.events
            )
            self.saver.busy = self.exporter.busy
        if self.will_save:
            check_one_filesystem(self.dir)
            # The other ranks wait for the lease in a collective: its timeout bounds the wait.
            wait_s = min(self.cfg.owner_wait_s, 0.8 * collective_timeout_s)
            decide_on_main(lambda: self._take_lease(wait_s), what="take the checkpoint location")

    def holder(self) -> str | None:
        """Which live run holds the checkpoint location now, for `kiln check` (None: none)."""
        held = owner_of(self.dir)
        if held is None or held.expired():
            return None
        return f"{held.describe()}; kiln train waits up to checkpoint.owner_wait_s for it"

    def _take_lease(self, wait_s: float) -> None:
        shared = f"{self.dir} via {self.lighthouse}" if self.fault_tolerant else None
        lease = Lease(self.dir, run=run_identity(fault_tolerant=shared), run_dir=self.run_dir)
        lease.take(wait_s=wait_s)
        self.lease = lease
        self.saver.still_owned = lease.check_held

    def save(self, step: int, **state: Any) -> None:
        """Checkpoint `step` (in the background with checkpoint.async_mode = "async", after
        committing a save still in flight)."""
        self._committed(self.saver.wait(after_step=step))
        record = self.saver.save(step, **state)
        self.last_saved_step = step
        if record is None:
            _say(f"checkpoint of step {step}: writing in the background")
        self._committed(record)

    def is_saved(self, step: int) -> bool:
        return self.last_saved_step == step

    def written_locally(self) -> bool:
        """This rank's part of the background save is written (agree over ranks before
        `finish_save`)."""
        return self.saver.written_locally()

    def finish_save(self, *, after_step: int) -> None:
        """Collective: commit the save in flight, if any (call on every rank at the same step,
        `after_step` the last finished training step)."""
        self._committed(self.saver.wait(after_step=after_step))

    def _committed(self, record: SaveRecord | None) -> None:
        if record is None:
            return
        _say(
            f"checkpoint of step {record.step} committed after step "
            f"{record.committed_after_step} ({record.mode}: written in {record.write_s:.2f} s, "
            f"training blocked {record.blocked_s:.2f} s): {record.path}"
        )
        self.events.write(
            "checkpoint",
            step=record.step,
            mode=record.mode,
            committed_after_step=record.committed_after_step,
            blocked_s=round(record.blocked_s, 4),
            write_s=round(record.write_s, 4),
            path=record.path,
        )
        self.last_committed = record
        if self.exporter is not None and self.export_hf == "every_save":
            self.exporter.start(record.path)

    @property
    def stop_save_seconds(self) -> float:
        """What saving costs a stop now: the rest of the save in flight, then one of the step."""
        return self.saver.stop_seconds()

    def commit_finished_save(self, *, after_step: int) -> None:
        """After a failure, with no collective (a peer may be gone): commit the save in flight
        if every rank's part of it is written (see CheckpointSaver.commit_if_finished)."""
        if self.saver is None:
            return
        try:
            self._committed(self.saver.commit_if_finished(after_step=after_step))
        except Exception as error:  # the failure being handled is the one to report
            warn(f"the save in flight was not committed: {error}")

    def close(self, *, after_step: int) -> None:
        """Collective: commit the save in flight, release the saver and the location's lease."""
        if self.saver is not None:
            self._committed(self.saver.close(after_step=after_step))
        if self.exporter is not None:
            final = self.last_committed
            if self.export_hf == "final" and final and final.step == self.max_steps:
                self.exporter.start(final.path)
            self.exporter.finish()  # before the lease goes: the export reads the checkpoint
        if self.lease is not None:
            self.lease.release()

    def rollback(self, *, at_step: int, model: Modules, optimizer: Optimizers) -> dict:
        """Back from `at_step` to the newest committed checkpoint (agreed on rank 0); its train
        state."""
        self._committed(self.saver.wait(after_step=at_step))
        # Judged as a resume judges: never the damaged checkpoint a resume passed over.
        newest = decide_on_main(
            lambda: resume_candidates(self.dir)[0], what="find a checkpoint to roll back to"
        )
        if newest is None:
            raise KilnError(
                "resilience.nan_action = 'rollback' but there is no checkpoint to return to; "
                "lower checkpoint.interval"
            )
        state = load_checkpoint(newest, model=model, optimizer=optimizer)
        self.last_saved_step = state["step"]
        self.saver.newest = newest
        self.events.write("rollback", from_step=at_step, step=state["step"], path=newest)
        return state | {"path": newest}

    def newest(self) -> Location | None:
        """The newest intact checkpoint, for messages: the resume point, then each commit and
        rollback, kept in memory the same on every rank (an error path on any rank names it
        without listing). Rank 0 judges the folder when this process committed none (another
        replica group writes the run's checkpoints)."""
        known = self.saver.newest if self.saver is not None else None
        if known is None and is_main():
            try:
                known = resume_candidates(self.dir)[0]
            except OSError:
                return None
        return known


# Settings a warm start may change: they do not change what the loaded weights compute.
_FREE_MODEL_KEYS = ("preset", "init_std", "max_seq_len")


def _check_expert_count(path: Location, saved: int, current: int) -> None:
    """The expert weights are stacked (experts × …) tensors: another count cannot load, whatever
    the layout, so a resume is refused even when forced."""
    if saved == current:
        return
    held = (
        f"a model with {saved} experts per MoE block (model.moe.num_experts = {saved})"
        if saved
        else "a dense model (model.moe.num_experts = 0)"
    )
    here = f"this model has {current}" if current else "this model is dense (0)"
    raise ConfigError(
        f"{path} holds {held}, but {here}: expert counts cannot change on resume, not even "
        "with checkpoint.resume = 'force' (the expert weights would not load). Set "
        f"model.moe.num_experts = {saved} to continue this run, or start a new run in another "
        "metrics.run_dir (or checkpoint.dir); to reuse the weights, convert them to the new "
        "expert count first"
    )


def _check_same_model(path: Location, model: ModelConfig) -> None:
    """Weights mean something only under the model settings they were trained with: a converted
    Llama 3.1 model loaded without its RoPE scaling would load cleanly and compute something else.
    Shapes that differ would fail to load; settings that differ silently are refused here."""
    changes = [
        f"model.{key}: {old!r} in the checkpoint, {new!r} here"
        for key, old, new in model_differences(read_model_config(path), model)
    ]
    if changes:
        raise ConfigError(
            f"checkpoint.load_path {path} holds a model with other settings ({'; '.join(changes)}); "
            "set those [model] keys to the checkpoint's values (its config.toml lists them)"
        )


def model_differences(saved: ModelConfig, model: ModelConfig) -> list[tuple[str, Any, Any]]:
    """The [model] settings (key, saved, here) that differ and give the weights their meaning:
    all but those a warm start may change."""
    return [
        (key, old, new)
        for key, old, new in _model_settings(saved, model)
        if key not in _FREE_MODEL_KEYS and old != new
    ]


def _model_settings(saved: ModelConfig, model: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) of every [model] key, those of [model.moe] as moe.<key>."""
    pairs = []
    for key in (f.name for f in fields(ModelConfig)):
        if key == "moe":
            pairs += [
                (f"moe.{f.name}", getattr(saved.moe, f.name), getattr(model.moe, f.name))
                for f in fields(MoEConfig)
            ]
        else:
            pairs.append((key, getattr(saved, key), getattr(model, key)))
    return pairs


def _say(message: str) -> None:
    """Rank 0 tells where the run starts from, on stdout with its progress."""
    if is_main():
        info(message, stdout=True)
