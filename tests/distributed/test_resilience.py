"""Jobs that are told to stop, lose a rank or blow up: real processes, real signals.

Ranks are started by hand (RANK, WORLD_SIZE, MASTER_ADDR) where the test must see what kiln
itself does to a process (signals, a killed peer), by torchrun where the launcher's part
(restarts) is under test, and on a gang (workers.py) where only kiln's decisions are (NaN steps)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.events import read_events
from tests.distributed.launch import (
    kiln_args,
    log,
    losses,
    start_ranks,
    wait_all,
    wait_for_step,
)
from tests.distributed.workers import JobFailed, kiln_train

PREEMPTED = 75


def test_signal_to_one_rank_stops_all_at_a_step_with_a_checkpoint_and_resumes_bitwise(
    gangs, tmp_path, demo_data
):
    # Rank 1 is signalled once step 3 is logged: the steps after it leave the signal time to
    # land however loaded the machine is (it stops at step 4 or 5 on a quiet one).
    steps = 24
    overrides = [
        f"--train.max_steps={steps}",
        "--train.batch_size=2",
        "--checkpoint.interval=0",
        "--checkpoint.async_mode='async'",
    ]
    # The uninterrupted run needs no signals of its own: a gang runs it (workers.py).
    reference = tmp_path / "reference"
    gangs.run(2, kiln_train, kiln_args(reference, demo_data, *overrides))

    run = tmp_path / "run"
    procs = start_ranks(2, kiln_args(run, demo_data, *overrides), tmp_path / "logs")
    wait_for_step(run, 3, procs)
    procs[1].send_signal(signal.SIGUSR1)  # rank 0 is never told: it must learn it from rank 1
    assert wait_all(procs, 120) == [PREEMPTED, PREEMPTED], log(tmp_path / "logs")
    stopped = int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert 3 <= stopped < steps
    # Rank 0 got no signal and learnt of it at the step boundary.
    assert "stopped by a signal on another rank" in log(tmp_path / "logs", 0)
    assert f"code {PREEMPTED}" in log(tmp_path / "logs", 0)

    procs = start_ranks(2, kiln_args(run, demo_data, *overrides), tmp_path / "resume_logs")
    assert wait_all(procs, 300) == [0, 0], log(tmp_path / "resume_logs")
    assert f"resumed from {run / 'checkpoints'}" in log(tmp_path / "resume_logs")
    assert losses(run) == losses(reference)  # bitwise, every step


def test_a_killed_rank_ends_the_job_and_torchrun_restarts_it_from_the_checkpoint(
    tmp_path, demo_data
):
    # Long enough for a slow step on two busy cores; every second of it is waited out below,
    # while the second part (the launcher's restart) starts beside it.
    timeout = 12
    overrides = [
        "--train.max_steps=200",
        "--train.batch_size=1",
        f"--resilience.collective_timeout_s={timeout}",
        "--checkpoint.interval=3",
        "--checkpoint.async_mode='async'",
    ]
    run = tmp_path / "run"
    # Rank 1 is SIGKILLed once every rank has written its part of step 3's background save,
    # before any step boundary commits it.
    module = "tests.distributed.dies_after_save_kiln"
    procs = start_ranks(3, kiln_args(run, demo_data, *overrides), tmp_path / "logs", module=module)
    assert procs[1].wait(timeout=120) == -signal.SIGKILL, log(tmp_path / "logs", 1)
    started = time.monotonic()

    # The launcher's part: a rank dies, torchrun restarts the job, which resumes and finishes.
    elastic = tmp_path / "elastic"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "-m",
        "kiln",
        "train",
        *kiln_args(elastic, demo_data, "--train.max_steps=12", "--train.batch_size=1"),
        "--checkpoint.interval=2",
    ]
    launcher = subprocess.Popen(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    wait_for_step(elastic, 5, [launcher])
    workers = _children(launcher.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)

    codes = wait_all([procs[r] for r in (0, 2)], timeout + 30)
    assert all(code != 0 for code in codes), codes
    assert time.monotonic() - started < timeout + 30
    assert "a collective failed during step" in log(tmp_path / "logs", 0)
    # Every rank had written step 3: rank 0 commits it on its way out, and names it.
    assert (run / "checkpoints" / "latest").read_text() == "step_00000003\n"
    assert "checkpoint of step 3 committed after step 3" in log(tmp_path / "logs", 0)
    assert f"resumes from {run / 'checkpoints' / 'step_00000003'} when" in log(tmp_path / "logs", 0)

    output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, output[-3000:]
    assert "kiln: resumed from" in output
    assert max(losses(elastic)) == 12


def _children(pid: int) -> list[int]:
    return sorted(map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split()))


def test_non_finite_steps_are_skipped_on_every_rank_then_rolled_back(gangs, tmp_path, demo_data):
    """Then a loss spike (test-side: step 13's reported gradient norm), skipped on both ranks,
    after a rollback that took the spike history from the checkpoint."""
    run = tmp_path / "run"
    overrides = [
        "--train.max_steps=14",
        "--train.batch_size=2",
        "--checkpoint.interval=4",
        "--resilience.debug_nan_steps=[3, 7, 8]",
        "--resilience.nan_max_consecutive=2",
        "--resilience.nan_action='rollback'",
        "--resilience.spike_action=skip",
        "--resilience.spike_window=10",
    ]
    # Rank 1 cannot list the checkpoint folder (a throttled or lagging view of the store): the
    # rollback still loads what rank 0 chose, since no other rank lists or judges a checkpoint.
    log, _ = gangs.run(
        2, kiln_train_with_a_spike_where_rank_1_cannot_list, kiln_args(run, demo_data, *overrides)
    )
    assert "step 3: non-finite loss" in log and "(1 in a row" in log
    assert "rolled back from step 8 to" in log and "step_00000004" in log
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 15))
    assert math.isnan(records[2]["loss"]) and math.isfinite(records[3]["loss"])
    assert records[-1]["skipped_steps"] == 3
    spikes = [e for e in read_events(run) if e["event"] == "spike_skip"]
    assert [e["step"] for e in spikes] == [SPIKE_STEP] and "step 13: loss spike" in log


SPIKE_STEP = 13


def test_a_spike_is_skipped_alike_under_tensor_and_pipeline_parallel(gangs, tmp_path, demo_data):
    """The spike of step 13 (test-side, as above) under tp=2 × pp=2, judged on the last stage's
    loss and the gradient norm summed over stages and tp shards: every rank skips it, one event.
    (A resume deciding alike is the test above: its rollback restores the window.)"""
    overrides = [
        f"--train.max_steps={SPIKE_STEP}",
        "--distributed.tp=2",
        "--distributed.pp=2",
        "--checkpoint.interval=0",
        "--resilience.spike_action=skip",
        "--resilience.spike_window=10",
    ]
    run = tmp_path / "run"
    gangs.run(
        4, kiln_train_with_a_spike_where_rank_1_cannot_list, kiln_args(run, demo_data, *overrides)
    )
    assert [e["step"] for e in read_events(run) if e["event"] == "spike_skip"] == [SPIKE_STEP]
    assert sorted(losses(run)) == list(range(1, SPIKE_STEP + 1))


def kiln_train_with_a_spike_where_rank_1_cannot_list(args: list[str]) -> None:
    """`kiln train ARGS` where every listing or lookup of rank 1 in the checkpoint store fails,
    and step SPIKE_STEP reports a gradient norm 1000 times the true one on every rank."""
    import kiln.train.step as step_module
    from kiln.checkpoint.store import LocalStore

    def refused(self, path, *args):
        raise OSError(f"rank 1 may not look at {path}")

    current, call, clip = [0], step_module.TrainStep.__call__, step_module.clip_grad_norm

    def calling(self, batch, *, step, flags):
        current[0] = step
        return call(self, batch, step=step, flags=flags)

    def clipping(*args, **kwargs):
        return clip(*args, **kwargs) * (1000 if current[0] == SPIKE_STEP else 1)

    names = ("children", "files", "exists", "is_file")
    real = {name: getattr(LocalStore, name) for name in names}
    if os.environ["RANK"] == "1":
        for name in names:
            setattr(LocalStore, name, refused)
    step_module.TrainStep.__call__, step_module.clip_grad_norm = calling, clipping
    try:
        kiln_train(args)
    finally:
        step_module.TrainStep.__call__, step_module.clip_grad_norm = call, clip
        for name, method in real.items():
            setattr(LocalStore, name, method)


def test_too_many_non_finite_steps_stop_the_job_with_a_message(gangs, tmp_path, demo_data):
    args = kiln_args(
        tmp_path / "run",
        demo_data,
        "--train.max_steps=10",
        "--resilience.debug_nan_steps=[2, 3]",
        "--resilience.nan_max_consecutive=2",
    )
    with pytest.raises(JobFailed) as failed:
        gangs.run(1, kiln_train, args)
    assert "exited with code 2" in failed.value.errors[0]
    (output,) = failed.value.outputs
    assert "2 steps in a row up to step 3 had a non-finite loss" in output
    assert "Traceback" not in output


def kiln_train_as_two_nodes(args: list[str], nodes: str) -> None:
    """`kiln train ARGS` with each rank the first of a node of its own (LOCAL_RANK 0), working
    in its own folder under `nodes`: a relative checkpoint.dir is a different folder on each."""
    own = Path(nodes) / f"node_{os.environ['RANK']}"
    own.mkdir(parents=True, exist_ok=True)
    before, local_rank = os.getcwd(), os.environ["LOCAL_RANK"]
    os.chdir(own)
    os.environ["LOCAL_RANK"] = "0"
    try:
        kiln_train(args)
    finally:
        os.chdir(before)
        os.environ["LOCAL_RANK"] = local_rank


def test_a_checkpoint_dir_that_is_not_shared_by_the_nodes_stops_the_start(
    gangs, tmp_path, demo_data
):
    args = kiln_args(tmp_path / "run", demo_data, "--checkpoint.dir=checkpoints")
    with pytest.raises(JobFailed) as failed:
        gangs.run(2, kiln_train_as_two_nodes, args, str(tmp_path))
    assert all("exited with code 2" in error for error in failed.value.errors.values())
    output = "".join(failed.value.outputs)  # rank 0 prints the error; rank 1 raised it too
    assert "checkpoint.dir checkpoints is not one shared filesystem" in output
    assert "(rank 1 on" in output and "Traceback" not in output
    assert not list(tmp_path.glob("node_*/checkpoints/*"))  # each node's token removed
