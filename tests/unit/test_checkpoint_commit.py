"""Checkpoints where users meet them, through the training loop on one process: an async save
writes while the next steps train, every commit is recorded in events.jsonl, and a checkpoint
whose small files a hard stop left empty is skipped by the same command, which resumes from the
previous one and reproduces the uninterrupted run bitwise."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import kiln.checkpoint.saver
import kiln.checkpoint.store
import kiln.train.trainer
from kiln.checkpoint import load_checkpoint
from kiln.checkpoint.layout import damage, resolve_checkpoint
from kiln.cli import main
from kiln.errors import KilnError
from kiln.events import read_events
from tests.conftest import DEBUG_CONFIG
from tests.unit.test_trainer import make_trainer

STEPS = 6


def _run(overrides, run_dir: Path, *extra: str):
    """Train the debug model in `run_dir` to STEPS (or stop_at_step) with a save every 2 steps."""
    trainer = make_trainer(
        overrides,
        f"--metrics.run_dir={run_dir}",
        f"--train.max_steps={STEPS}",
        "--checkpoint.interval=2",
        "--checkpoint.keep_last_n=0",
        "--metrics.log_interval=1",
        *extra,
    )
    return trainer, trainer.train()


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _weights(trainer, step_dir: Path) -> dict[str, torch.Tensor]:
    load_checkpoint(step_dir, model=trainer.model_parts)
    return {k: v.clone() for k, v in trainer.model_parts[0].state_dict().items()}


@pytest.fixture
def slow_first_write(monkeypatch):
    """A test-only slow writer: the background write of the first async save finishes only when
    `release` is set (the real write runs, its result is held back). Later saves are not held."""
    release, real_async_save, held = threading.Event(), dcp.async_save, []

    def async_save(*args, **kwargs):
        written = real_async_save(*args, **kwargs)
        if held:
            return written
        gated: Future = Future()
        held.append(gated)

        def finish_when_released():
            release.wait(timeout=120)
            error = written.exception()
            gated.set_exception(error) if error else gated.set_result(written.result())

        threading.Thread(target=finish_when_released, daemon=True).start()
        return gated

    monkeypatch.setattr(kiln.checkpoint.saver.dcp, "async_save", async_save)
    return release


def test_an_async_save_writes_while_the_next_step_trains(
    debug_overrides, tmp_path, monkeypatch, slow_first_write
):
    """The save of step 2 is still being written when step 3 ends; it is committed later, at a
    step boundary, and the losses and the final checkpoint are bitwise a sync run's."""
    sync_trainer, _ = _run(debug_overrides, tmp_path / "sync")
    observed = []
    original_step = kiln.train.trainer.Trainer.train_step

    def step_then_look(self, **flags):
        result = original_step(self, **flags)
        in_flight = self.checkpoints.saver.in_flight
        observed.append((self.step, in_flight and in_flight.step, in_flight is not None))
        if self.step == 3:  # the write of step 2 may finish from now on
            slow_first_write.set()
        return result

    monkeypatch.setattr(kiln.train.trainer.Trainer, "train_step", step_then_look)
    async_dir = tmp_path / "async"
    async_trainer, _ = _run(debug_overrides, async_dir, "--checkpoint.async_mode='async'")
    assert observed[2] == (3, 2, True), observed  # step 3 ended with step 2's save in flight
    events = {e["step"]: e for e in read_events(async_dir) if e["event"] == "checkpoint"}
    assert sorted(events) == [2, 4, 6]
    assert events[2]["mode"] == "async" and events[2]["committed_after_step"] >= 3
    assert all(e["write_s"] >= 0 and e["blocked_s"] >= 0 for e in events.values())
    # Same operations in the same order as the sync run: bitwise.
    assert _losses(async_dir) == _losses(tmp_path / "sync")
    for step in (2, 4, 6):
        name = f"step_{step:08d}"
        sync_weights = _weights(sync_trainer, tmp_path / "sync" / "checkpoints" / name)
        async_weights = _weights(async_trainer, async_dir / "checkpoints" / name)
        assert all(torch.equal(sync_weights[k], v) for k, v in async_weights.items()), step


@pytest.fixture
def torch_2_11_writer(monkeypatch):
    """DCP's file writer as torch 2.11 has it: `finish` fills in the storage data of a copy of
    the metadata, so what dcp.save (and an async save's future) returns names no file (torch
    2.13 fills in the one it returns). A commit that trusted it failed every save on 2.11."""

    class Writer(FileSystemWriter):
        def finish(self, metadata, results):
            super().finish(dataclasses.replace(metadata), results)

    monkeypatch.setattr(kiln.checkpoint.store.LocalStore, "writer", lambda _, path: Writer(path))


def test_an_async_run_resumed_matches_the_uninterrupted_run(
    debug_overrides, tmp_path, torch_2_11_writer
):
    """Stop at step 4 with its save in the background, resume to the end: bitwise. Sync and
    async saves commit (and the resume loads) under torch 2.11's writer too."""
    _run(debug_overrides, tmp_path / "whole")
    resumed = tmp_path / "resumed"
    _run(debug_overrides, resumed, "--checkpoint.async_mode='async'", "--train.stop_at_step=4")
    _run(debug_overrides, resumed, "--checkpoint.async_mode='async'")
    assert _losses(resumed) == _losses(tmp_path / "whole")
    kinds = [e["event"] for e in read_events(resumed)]
    assert kinds.count("resume") == 1 and kinds.count("stop") == 2
    stops = [e["reason"] for e in read_events(resumed) if e["event"] == "stop"]
    assert stops == ["train.stop_at_step", "train.max_steps"]


def _empty_small_files(step_dir: Path) -> None:
    """What a hard stop right after a commit can leave when nothing was fsynced: names in place,
    contents never written."""
    for name in ("COMPLETE", "train_state.json", "config.toml", "rng/rank_00000.pt"):
        (step_dir / name).write_bytes(b"")
    (step_dir.parent / "latest").write_bytes(b"")


def _train_args(demo_data: Path, *extra: str) -> list[str]:
    """`kiln train` of the debug model with a committed checkpoint every 2 steps, all kept."""
    return [
        "train",
        str(DEBUG_CONFIG),
        f"--data.path={demo_data}",
        "--data.num_workers=0",
        "--checkpoint.interval=2",
        "--checkpoint.keep_last_n=0",
        *extra,
    ]


@pytest.mark.parametrize("damaged", ["small files", "train state"])
def test_a_hard_stop_after_a_commit_resumes_from_the_previous_checkpoint(
    demo_data, tmp_path, monkeypatch, capsys, damaged
):
    """The same command, run again after the newest checkpoint's small files were emptied,
    resumes from the one before it on its own, says which it skipped and why, and reproduces
    the uninterrupted losses bitwise (the same operations in the same order)."""
    monkeypatch.chdir(tmp_path)
    args = _train_args(demo_data, f"--train.max_steps={STEPS}", "--metrics.log_interval=1")
    assert main([*args, "--metrics.run_dir=whole"]) == 0
    assert main([*args, "--metrics.run_dir=cut", "--train.stop_at_step=4"]) == 0
    newest = Path("cut", "checkpoints", "step_00000004")  # as the run names it: relative
    if damaged == "small files":
        _empty_small_files(newest)
    else:
        (newest / "train_state.json").write_text("{")  # same size, unreadable: not the manifest
        (newest / "COMPLETE").write_text(json.dumps({"step": 4, "files": {"train_state.json": 1}}))
    capsys.readouterr()
    assert main([*args, "--metrics.run_dir=cut"]) == 0
    err = capsys.readouterr().err
    assert f"skipping {newest}" in err
    reason = "COMPLETE marker is empty" if damaged == "small files" else "train_state.json is empty"
    assert reason in err
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "whole")
    (resume,) = [e for e in read_events(tmp_path / "cut") if e["event"] == "resume"]
    assert resume["step"] == 2 and resume["kind"] == "resume"
    assert resume["skipped"][0]["path"] == str(newest)
    assert reason in resume["skipped"][0]["reason"]


def test_no_intact_checkpoint_lists_what_was_found(demo_data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = _train_args(
        demo_data, "--train.max_steps=4", "--scheduler.warmup_steps=1", "--metrics.run_dir=run"
    )
    assert main(args) == 0
    for step in (2, 4):
        _empty_small_files(tmp_path / "run" / "checkpoints" / f"step_{step:08d}")
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "none is intact" in err
    assert "step_00000002: its COMPLETE marker is empty" in err
    assert "step_00000004: its COMPLETE marker is empty" in err


def test_a_commit_fsyncs_every_file_and_folder_before_it_is_published(
    debug_overrides, tmp_path, monkeypatch
):
    """Each file of the checkpoint, its folders, the marker and `latest` reach the disk, and the
    partial folder's contents before the rename that publishes them."""
    synced: list[Path] = []
    real_fsync = kiln.checkpoint.store.os.fsync

    def fsync(fd):
        synced.append(Path(f"/proc/self/fd/{fd}").resolve())
        real_fsync(fd)

    monkeypatch.setattr(kiln.checkpoint.store.os, "fsync", fsync)
    trainer = make_trainer(debug_overrides, "--train.max_steps=8")
    trainer.train_step()
    trainer.save()
    root = tmp_path / "run" / "checkpoints"
    final = root / "step_00000001"
    partial = root / ".step_00000001.partial"

    def was_synced(path: Path) -> bool:
        """Synced itself, or as the temporary file that then replaced it whole."""
        return path in synced or any(
            p.parent == path.parent and p.name.startswith(f".{path.name}.") and p.suffix == ".tmp"
            for p in synced
        )

    files = [p.relative_to(final) for p in final.rglob("*")]
    for name in files:
        assert was_synced(partial / name), name  # while still hidden: before the rename
    assert root in synced and was_synced(root / "latest")
    assert synced.index(root) > synced.index(partial)


def test_an_unreadable_marker_is_damage_not_an_old_format(tmp_path):
    step = tmp_path / "step_00000002"
    step.mkdir()
    (step / "COMPLETE").write_text("2\n")  # kiln's first markers held only the step
    assert damage(step) is None
    (step / "COMPLETE").write_bytes(b"")
    assert "COMPLETE marker is empty or unreadable" in damage(step)
    (step / "COMPLETE").write_bytes(b"\xff\xfe")
    assert "COMPLETE marker is empty or unreadable" in damage(step)
    with pytest.raises(KilnError, match="empty or unreadable"):
        resolve_checkpoint(step)


def _probe_new_folders(root: Path, tries: int, barrier, failures) -> None:
    from kiln.checkpoint.store import LocalStore

    for i in range(tries):
        barrier.wait()  # both processes probe the same new folder at the same moment
        try:
            LocalStore().check_writable(root / f"new_{i}" / "checkpoints")
        except KilnError as error:
            failures.put(str(error))
    failures.put(None)


def test_two_jobs_probing_one_new_folder_both_find_it_writable(tmp_path):
    """The replica groups of a fault-tolerant run probe one new checkpoint folder at once: one's
    clean-up removing the folder under the other's probe is not "not writable"."""
    context = multiprocessing.get_context("fork")
    barrier, failures = context.Barrier(2), context.Queue()
    jobs = [
        context.Process(target=_probe_new_folders, args=(tmp_path, 150, barrier, failures))
        for _ in range(2)
    ]
    for job in jobs:
        job.start()
    reported = [failures.get(timeout=120) for _ in range(2)]
    for job in jobs:
        job.join()
    assert reported == [None, None]  # each job's end, with no failure before it
    # No probe is left; a new folder may be (the other job's probe was in it at its clean-up).
    assert not list(tmp_path.rglob(".write_test*"))


def test_async_process_in_one_process_says_to_use_async(tmp_path):
    # DCP's writer process finds its peers through the job's process group: one process has none.
    with pytest.raises(KilnError, match=r'needs a job of several processes.*use "async"'):
        kiln.checkpoint.saver.CheckpointSaver(tmp_path, async_mode="async_process")
