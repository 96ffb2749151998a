"""Where a run stops and how it goes on: train.stop_at_step, train.time_limit_minutes,
Ctrl-C, and the end of a run whose last checkpoint is still being written in the background.
`kiln train` as the command line runs it, on a gang's process (workers.py) where only kiln's own
decisions are under test, in processes of their own where signals are; resumed losses are
compared bit for bit with a run that never stopped.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import delayed_commit_kiln
from tests.distributed.launch import (
    env,
    kiln_args,
    log,
    losses,
    start_ranks,
    wait_all,
    wait_for_step,
)
from tests.distributed.workers import JobFailed, kiln_train

STEPS = 12
# A cosine schedule over 12 steps: a resumed run that reshaped it would differ from step 7 on.
COSINE = [f"--train.max_steps={STEPS}", "--scheduler.name=cosine", "--scheduler.warmup_steps=2"]
COMMON = [*COSINE, "--train.batch_size=2", "--data.num_workers=0"]


class Finished:
    def __init__(self, code: int, output: str):
        self.returncode, self.output = code, output


@pytest.fixture
def kiln_run(gangs, demo_data):
    """kiln_run(run_dir, *overrides): `kiln train` on a one-process gang; its exit code and
    output (stdout and stderr)."""

    def run(run_dir: Path, *overrides: str) -> Finished:
        try:
            (output,) = gangs.run(1, kiln_train, kiln_args(run_dir, demo_data, *overrides))
        except JobFailed as failed:
            code = int(re.search(r"exited with code (\d+)", failed.errors[0]).group(1))
            return Finished(code, failed.outputs[0])
        return Finished(0, output)

    return run


@pytest.fixture(scope="module")
def uninterrupted(gangs, tmp_path_factory, demo_data) -> dict[int, float]:
    """The per-step losses of the run that never stops, which every stopped run must reproduce."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    gangs.run(1, kiln_train, kiln_args(run_dir, demo_data, *COMMON))
    return losses(run_dir)


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def test_stop_at_step_ends_with_a_checkpoint_and_the_same_command_continues_bitwise(
    tmp_path, kiln_run, uninterrupted
):
    run = tmp_path / "run"
    first = kiln_run(run, *COMMON, "--train.stop_at_step=6")
    assert first.returncode == 0, first.output
    assert "stopped after step 6 of 12 (train.stop_at_step)" in first.output
    assert _latest(run) == "step_00000006"
    rest = kiln_run(run, *COMMON)
    assert rest.returncode == 0, rest.output
    assert "resumed from" in rest.output and "(step 6)" in rest.output
    assert losses(run) == uninterrupted  # every step, bit for bit

    again = kiln_run(run, *COMMON, "--train.stop_at_step=3")
    assert again.returncode == 2
    assert "train.stop_at_step = 3 but this run resumes at step 10" in again.output


def test_a_time_limit_stops_with_a_checkpoint_and_the_run_continues_bitwise(
    tmp_path, kiln_run, uninterrupted
):
    """A limit already spent at the first check (0.001 min, less than start-up takes) makes the
    stop step deterministic: the first step runs, then the job saves and exits 0."""

    run = tmp_path / "run"
    limited = kiln_run(run, *COMMON, "--train.time_limit_minutes=0.001")
    assert limited.returncode == 0, limited.output
    assert "stopped after step 1 of 12 (train.time_limit_minutes)" in limited.output
    assert _latest(run) == "step_00000001"
    rest = kiln_run(run, *COMMON)
    assert rest.returncode == 0, rest.output
    assert losses(run) == uninterrupted


def test_ctrl_c_saves_and_says_where_the_run_resumes(tmp_path, demo_data):
    """Ctrl-C reaches the terminal's foreground process group: kiln and not its loader workers
    (they leave the group), so the step in progress finishes and a checkpoint is written."""
    run = tmp_path / "run"
    logs = tmp_path / "log.txt"
    # With its plot: a stopped run (no end-of-run summary) draws it at its checkpoint.
    args = kiln_args(
        run, demo_data, "--train.max_steps=400", "--train.batch_size=1", "--metrics.plot=true"
    )
    with logs.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kiln", "train", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env(),
            start_new_session=True,
        )
        wait_for_step(run, 3, [proc])
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130, logs.read_text()
    text = logs.read_text()
    stopped = int(_latest(run).removeprefix("step_"))
    assert 3 <= stopped < 400
    assert f"stopped by SIGINT after step {stopped}" in text
    assert f"resume from step {stopped}" in text and "Traceback" not in text
    assert (run / "loss_curve.png").is_file()


def test_async_final_save_finishing_first_on_one_rank_does_not_hang(tmp_path, demo_data):
    """Rank 1 finishes writing its part of the last checkpoint (step 4) while rank 0 is still
    committing it: a test patch delays rank 0's commit by 3 s and holds rank 1 until its write
    is done. Every rank must agree that the final step is saved. Before the run state was kept by
    the CheckpointManager, rank 1 read the old `latest` from disk, saved again alone, and failed in
    a collective once rank 0 had exited (exit 2, or a hang until the collective timeout)."""
    run = tmp_path / "run"
    overrides = [
        "--train.max_steps=4",
        "--scheduler.warmup_steps=1",
        "--checkpoint.interval=2",
        "--checkpoint.async_mode='async'",
        "--checkpoint.save_final=true",
        "--resilience.collective_timeout_s=60",
        "--train.batch_size=2",
    ]
    args = kiln_args(run, demo_data, *overrides)
    procs = start_ranks(2, args, tmp_path / "logs", module="tests.distributed.delayed_commit_kiln")
    assert wait_all(procs, 120) == [0, 0], log(tmp_path / "logs", 1)
    assert delayed_commit_kiln.NOTICE in log(tmp_path / "logs", 0)
    assert _latest(run) == "step_00000004"
    marker = json.loads((run / "checkpoints" / "step_00000004" / "COMPLETE").read_text())
    assert marker["step"] == 4
