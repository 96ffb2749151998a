"""Write checkpoints, synchronously or in the background (`checkpoint.async_mode = "async"`:
DCP's writer in a thread of the training process; `"async_process"`: in a process of its own).

A save goes through three phases, each agreed by every rank so that a failure on one rank (a
full disk, a directory that cannot be written) stops all of them with the same message instead
of leaving the others waiting:

1. rank 0 clears what an interrupted save left, writes the small files into the save's staging
   folder (a hidden partial folder on a filesystem, the step's own prefix in an object store);
   every rank writes its RNG;
2. DCP writes the sharded model and optimizer state (in a background thread or process when
   async, after the state has been copied to CPU memory, pinned on GPU machines, shared with the
   writer process in process mode: all the training loop waits for);
3. rank 0 commits: the marker with the file manifest, `latest`, retention (`layout.commit`; on a
   filesystem every file and folder is fsynced and the folder renamed into place first).

A failed save removes its staging folder; the previous checkpoint and `latest` stay as they were.
Finishing a background save (`wait`) is collective too: the caller decides when, the same on
every rank (see CheckpointManager), and a failure on any rank is raised on all of them.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from kiln.checkpoint import layout
from kiln.checkpoint.state import (
    Modules,
    Optimizers,
    distributed,
    merged_state,
    rank,
    rng_state,
    single_process_quiet,
)
from kiln.checkpoint.store import Location, location, store_for
from kiln.config import JobConfig, to_toml
from kiln.errors import ConfigError, KilnError, first_line
from kiln.log import warn
from kiln.parallel.agree import raise_any_failure

SaveMode = Literal["sync", "async"]


@dataclass(frozen=True)
class SaveRecord:
    """What one committed checkpoint cost and when it became the one to resume from."""

    step: int
    mode: SaveMode
    committed_after_step: int  # the last training step that had finished at the commit
    blocked_s: float  # how long the training loop waited for it: staging, waiting, committing
    write_s: float  # from the start of the save until every rank's part was written
    path: Location


@dataclass
class _InFlight:
    step: int
    future: Future
    started: float
    staged_s: float
    own_files: list[str]
    finished: float | None = None


class CheckpointSaver:
    def __init__(
        self,
        root: Location | str,
        *,
        keep_last_n: int = 0,
        async_mode: str = "disabled",
        device: torch.device | None = None,
        timeout_s: float | None = None,
    ):
        self.root = location(root)
        self.store = store_for(self.root)
        self.keep_last_n = keep_last_n
        self.in_flight: _InFlight | None = None
        # The newest intact checkpoint, for messages: the resume point, then each commit. Kept
        # here, so an error on any rank names it without a listing.
        self.newest: Location | None = None
        # Raises an OSError when another run took the location over (the run's lease, set by
        # CheckpointManager on rank 0): checked before a save writes and before it commits.
        self.still_owned: Callable[[], None] = lambda: None
        # The checkpoints a Hugging Face export reads (rank 0): retention leaves them for now.
        self.busy: Callable[[], set[Location]] = set
        # Wall time of the last save from its start until written (the background part too).
        self.last_seconds = 0.0
        self._group = self._stager = None
        self._writer = AsyncCheckpointerType.THREAD
        if async_mode in ("async", "async_process"):
            on_gpu = device is not None and device.type == "cuda"
            in_process = async_mode == "async_process"
            if in_process and not distributed():
                # DCP's writer process joins the training processes' group to find its peers.
                raise ConfigError(
                    'checkpoint.async_mode = "async_process" needs a job of several processes '
                    '(torchrun); in one process use "async"'
                )
            if in_process:
                # Its own interpreter: the writer's Python work (DCP's planning, torch.save of
                # each tensor) no longer takes the GIL from the loop that launches the steps.
                self._writer = AsyncCheckpointerType.PROCESS
            # The background thread runs DCP's collectives; on the training group they would
            # interleave with the training loop's, so it gets a CPU group of its own, bounded
            # like the training group's (resilience.collective_timeout_s), not by torch's 30 min.
            timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
            group = dist.new_group(backend="gloo", timeout=timeout) if distributed() else None
            self._group = group
            if not distributed():  # DCP's warning about one process, raised in its thread
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=on_gpu,
                    # Shared, the staged state reaches the writer process as handles, not copies.
                    use_shared_memory=in_process,
                    use_async_staging=False,
                    use_non_blocking_copy=on_gpu,
                )
            )

    def save(
        self,
        step: int,
        *,
        model: Modules,
        optimizer: Optimizers,
        config: JobConfig,
        train_state: dict[str, Any],
        tokenizer_path: Path | None = None,
        extra: dict[str, torch.Tensor] | None = None,
    ) -> SaveRecord | None:
        """Write step `step`. Sync: commit it and return its record. Async: return None once the
        state is staged; `wait` commits it. A save still in flight is finished first. `extra`:
        more tensors (DTensors sharded as the parameters) the run resumes from (DiLoCo's)."""
        self.wait(after_step=step)  # one save in flight at most
        started = time.monotonic()
        partial = layout.partial_dir(self.root, step)
        own_files = _own_files(tokenizer=tokenizer_path is not None)
        failure = None
        if rank() == 0:
            failure = self._attempt(
                step, lambda: self._prepare(partial, step, config, train_state, tokenizer_path)
            )
        raise_any_failure(failure)
        raise_any_failure(self._attempt(step, lambda: self._write_rng(partial)))
        state = merged_state(model, optimizer) | ({"extra": extra} if extra else {})
        if self._stager is not None:
            with single_process_quiet():
                future = dcp.async_save(
                    state,
                    storage_writer=self.store.writer(partial),
                    process_group=self._group,
                    async_checkpointer_type=self._writer,
                    async_stager=self._stager,
                    no_dist=not distributed(),
                )
            staged_s = time.monotonic() - started
            in_flight = self.in_flight = _InFlight(step, future, started, staged_s, own_files)
            future.add_done_callback(lambda _: setattr(in_flight, "finished", time.monotonic()))
            return None
        try:
            with single_process_quiet():
                metadata = dcp.save(
                    state, storage_writer=self.store.writer(partial), no_dist=not distributed()
                )
        except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
            self._abandon(step)
            raise self._error(step, first_line(error)) from None
        self.last_seconds = time.monotonic() - started
        failure = None
        if rank() == 0:
            failure = self._attempt(step, lambda: self._commit(step, own_files, metadata))
        raise_any_failure(failure)
        blocked = time.monotonic() - started
        self.newest = layout.step_dir(self.root, step)
        return SaveRecord(step, "sync", step, blocked, self.last_seconds, self.newest)

    def written_locally(self) -> bool:
        """Whether this rank's part of the save in flight is written (none in flight: True)."""
        return self.in_flight is None or self.in_flight.future.done()

    def wait(self, *, after_step: int) -> SaveRecord | None:
        """Collective: block until the save in flight is written, commit it on rank 0, and raise
        any rank's failure on every rank. `after_step`: the last training step that has finished.
        Returns the committed save's record (none in flight: None)."""
        if self.in_flight is None:
            return None
        began = time.monotonic()
        in_flight, self.in_flight = self.in_flight, None
        failure = None
        try:
            metadata = in_flight.future.result()
        except (Exception, CheckpointException) as error:
            self._abandon(in_flight.step)
            failure = str(self._error(in_flight.step, first_line(error)))
        self.last_seconds = (in_flight.finished or time.monotonic()) - in_flight.started
        if failure is None and rank() == 0:
            failure = self._attempt(
                in_flight.step,
                lambda: self._commit(in_flight.step, in_flight.own_files, metadata),
            )
        raise_any_failure(failure)
        blocked = in_flight.staged_s + time.monotonic() - began
        self.newest = layout.step_dir(self.root, in_flight.step)
        return SaveRecord(
            in_flight.step, "async", after_step, blocked, self.last_seconds, self.newest
        )

    def stop_seconds(self) -> float:
        """What saving costs a stop now: the rest of the save in flight (estimated as long as
        the last save, from its start), then a save of the step."""
        if self.in_flight is None or self.in_flight.future.done():
            return self.last_seconds
        # The first save has no earlier one to go by: its own time so far is a lower bound.
        elapsed = time.monotonic() - self.in_flight.started
        save = max(self.last_seconds, elapsed)
        return save - elapsed + save

    def commit_if_finished(self, *, after_step: int) -> SaveRecord | None:
        """Without any collective, after a failure: commit the save in flight on rank 0 if DCP
        finished it there (its record), else drop it. Rank 0's part of a save ends only after
        every rank reported its files written and the metadata is written, so a finished one is
        whole; one still writing is left uncommitted (never loaded, cleared by the next save)."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None or rank() != 0 or not in_flight.future.done():
            return None
        try:
            self._commit(in_flight.step, in_flight.own_files, in_flight.future.result())
        except (Exception, CheckpointException) as error:
            warn(f"the save of step {in_flight.step} was not committed: {first_line(error)}")
            return None  # the previous checkpoint stays the newest
        self.last_seconds = (in_flight.finished or time.monotonic()) - in_flight.started
        self.newest = layout.step_dir(self.root, in_flight.step)
        return SaveRecord(
            in_flight.step, "async", after_step, in_flight.staged_s, self.last_seconds, self.newest
        )

    def close(self, *, after_step: int) -> SaveRecord | None:
        """Finish the save in flight (its record) and release the staging memory."""
        try:
            return self.wait(after_step=after_step)
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _prepare(
        self,
        partial: Location,
        step: int,
        config: JobConfig,
        train_state: dict[str, Any],
        tokenizer_path: Path | None,
    ) -> None:
        self.still_owned()
        layout.remove_partials(self.root)
        # In an object store the staging prefix is the step's own: a checkpoint of the same step
        # written before (a run continued from an earlier one) is replaced, marker first.
        self.store.remove(partial)
        self.store.write_bytes(partial / "config.toml", to_toml(config).encode())
        state = json.dumps({"step": step, **train_state}, indent=2) + "\n"
        self.store.write_bytes(partial / "train_state.json", state.encode())
        if tokenizer_path is not None:
            self.store.write_bytes(partial / "tokenizer.json", Path(tokenizer_path).read_bytes())

    def _write_rng(self, partial: Location) -> None:
        buffer = io.BytesIO()
        torch.save(rng_state(), buffer)
        self.store.write_own(partial / "rng" / f"rank_{rank():05d}.pt", buffer.getvalue())

    def _commit(self, step: int, own_files: list[str], metadata: Metadata) -> None:
        """Commit step `step`: kiln's own files and those DCP reports it wrote, its metadata
        file and each data file the metadata names (rank 0)."""
        storage = metadata.storage_data
        if storage is None:
            # torch 2.11's FileSystemWriter.finish fills in a copy of the metadata, not the one
            # dcp.save returns: the file it wrote holds the list.
            partial = layout.partial_dir(self.root, step)
            storage = self.store.reader(partial).read_metadata().storage_data
        files = sorted({info.relative_path for info in storage.values()})
        self.still_owned()
        final = layout.commit(self.root, step, written=[*own_files, ".metadata", *files])
        self.newest = final  # rank 0 knows at once, even if a peer fails the agreement after
        # Retention is best effort (on disk an rmtree that ignores errors): failing to delete an
        # old step must not undo the commit just made, which _attempt would on an OSError.
        with contextlib.suppress(OSError):
            layout.prune(self.root, self.keep_last_n, keep=final, busy=self.busy())

    def _attempt(self, step: int, action) -> str | None:
        """Run `action`; on an OS error return the message that every rank will raise."""
        try:
            action()
        except OSError as error:
            self._abandon(step)
            where = f": {error.filename}" if error.filename else ""
            return str(self._error(step, f"{error.strerror or error}{where}"))
        return None

    def _abandon(self, step: int) -> None:
        if rank() == 0:
            # Best effort: a store that cannot be reached keeps the leftovers, which are never
            # loaded and are cleared by the next save.
            with contextlib.suppress(OSError):
                self.store.remove(layout.partial_dir(self.root, step))

    def _error(self, step: int, cause: str) -> KilnError:
        kept = (
            f"the previous checkpoint {self.newest} is intact"
            if self.newest
            else "no earlier checkpoint of this run was kept"
        )
        return KilnError(
            f"could not write the checkpoint of step {step} to {self.root} ({cause}); {kept}. "
            "Free space or fix the permissions of checkpoint.dir, then resume"
        )


def _own_files(*, tokenizer: bool) -> list[str]:
    """The files kiln writes into a save beside DCP's: rank 0's small files, every rank's RNG."""
    ranks = dist.get_world_size() if distributed() else 1
    small = ["config.toml", "train_state.json", *(["tokenizer.json"] if tokenizer else [])]
    return small + [f"rng/rank_{r:05d}.pt" for r in range(ranks)]
