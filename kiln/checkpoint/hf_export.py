"""Hugging Face weights written by the run itself (`checkpoint.export_hf`).

Rank 0 exports a committed checkpoint after its commit, in a process of its own that runs what
`kiln convert kiln-to-hf` runs (`kiln_to_hf`): it reads the committed files, so it sees exactly
what was saved in any layout, needs no collective, and its memory (the model whole, in fp32) and
its failures stay out of the training process. One export runs at a time; a save committed
meanwhile waits, and a newer one replaces it (the run only ever falls behind by one). The run's
end waits for the export in flight. A failed export is a warning and an `export_hf` event; the
checkpoint stays.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from kiln.checkpoint.hf_convert import kiln_to_hf
from kiln.config import ModelConfig
from kiln.errors import ConfigError, KilnError, first_line
from kiln.events import EventLog
from kiln.log import info, warn
from kiln.model.registry import family_of
from kiln.remote import is_url

# The exports' folder in the checkpoint folder: <checkpoint.dir>/hf/step_XXXXXXXX.
EXPORT_DIR = "hf"


def check_exportable(export_hf: str, model: ModelConfig, *, directory: str) -> None:
    """ConfigError when `checkpoint.export_hf` asks for a model its family cannot export (what
    `kiln convert kiln-to-hf` would refuse) or beside checkpoints in an object store, before
    anything is built or written."""
    if export_hf == "never":
        return
    if is_url(directory):
        raise ConfigError(
            f'checkpoint.export_hf = "{export_hf}" writes a local folder beside the checkpoints, '
            f"but checkpoint.dir = {directory!r} is in an object store; leave export_hf out and "
            "run `kiln convert kiln-to-hf CKPT OUT` on the checkpoint after the run"
        )
    try:
        family_of(model).export_adapter(model)
    except KilnError as error:
        raise ConfigError(
            f'checkpoint.export_hf = "{export_hf}", but {first_line(error)}. '
            'Set checkpoint.export_hf = "never" or change those [model] keys'
        ) from None


class HfExporter:
    """Rank 0's background exports of the checkpoints under `root` into `root/hf`."""

    def __init__(self, root: Path, *, keep_last_n: int, events: EventLog):
        self.root, self.keep_last_n, self.events = root, keep_last_n, events
        self._lock = threading.Condition()
        self._running: Path | None = None
        self._waiting: Path | None = None
        self._thread: threading.Thread | None = None

    def busy(self) -> set[Path]:
        """The checkpoints an export reads or will read: retention leaves them for now."""
        with self._lock:
            return {path for path in (self._running, self._waiting) if path is not None}

    def start(self, step_dir: Path) -> None:
        """Export `step_dir` in the background (after the export in flight, if any)."""
        with self._lock:
            if self._waiting is not None:
                info(
                    f"Hugging Face export of {self._waiting.name} skipped: {step_dir.name} is newer"
                )
                self.events.write("export_hf", step=_step(self._waiting), skipped=True)
            self._waiting = step_dir
            if self._thread is None:
                # A daemon: a run that fails does not wait for it; the export process goes on
                # and writes its folder whole or not at all.
                self._thread = threading.Thread(
                    target=self._work, name="kiln-export-hf", daemon=True
                )
                self._thread.start()

    def finish(self) -> None:
        """Wait for the exports in flight and waiting (the time this adds to the run's end)."""
        with self._lock:
            thread = self._thread
            pending = [p.name for p in (self._running, self._waiting) if p is not None]
        if thread is None:
            return
        began = time.monotonic()
        info(f"waiting for the Hugging Face export of {', '.join(pending)}", stdout=True)
        thread.join()
        info(f"the Hugging Face export added {time.monotonic() - began:.2f} s to the run's end")

    def _work(self) -> None:
        while True:
            with self._lock:
                step_dir, self._waiting = self._waiting, None
                self._running = step_dir
                if step_dir is None:
                    self._thread = None
                    return
            try:
                self._export(step_dir)
            except Exception as error:  # e.g. no memory to start the process: the run goes on
                warn(f"the Hugging Face export of {step_dir} failed: {first_line(error)}")
                self.events.write("export_hf", step=_step(step_dir), error=first_line(error))
            finally:
                with self._lock:
                    self._running = None

    def _export(self, step_dir: Path) -> None:
        out = self.root / EXPORT_DIR / step_dir.name
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", __name__, str(step_dir), str(out)],
            capture_output=True,
            text=True,
        )
        seconds = round(time.monotonic() - began, 3)
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            error = lines[-1] if lines else f"exit status {done.returncode}"
            warn(
                f"the Hugging Face export of {step_dir} failed ({error}); the checkpoint is "
                f"intact: export it with `kiln convert kiln-to-hf {step_dir} OUT`"
            )
            self.events.write("export_hf", step=_step(step_dir), error=error, seconds=seconds)
            return
        info(f"Hugging Face weights of step {_step(step_dir)} in {seconds:.2f} s: {out}")
        self.events.write("export_hf", step=_step(step_dir), path=out, seconds=seconds)
        self._prune(keep=out)

    def _prune(self, *, keep: Path) -> None:
        """Keep as many exports as checkpoint.keep_last_n keeps checkpoints (0: all)."""
        if self.keep_last_n <= 0:
            return
        exports = sorted(p for p in (self.root / EXPORT_DIR).glob("step_*") if p != keep)
        for old in exports[: max(0, len(exports) - self.keep_last_n + 1)]:
            shutil.rmtree(old, ignore_errors=True)


def _step(step_dir: Path) -> int:
    return int(step_dir.name.removeprefix("step_"))


def _main(step_dir: str, out: str) -> None:
    """The export process: the training processes keep the CPU first; a run that saves the
    same step again (after a rollback) replaces that step's export."""
    os.nice(10)
    shutil.rmtree(out, ignore_errors=True)
    kiln_to_hf(step_dir, out)


if __name__ == "__main__":
    try:
        _main(*sys.argv[1:])
    except (KilnError, OSError) as error:
        print(f"kiln: error: {first_line(error)}", file=sys.stderr)
        sys.exit(1)
