"""Stopping on request, on their own: Ctrl-C twice, the time limit's arithmetic."""

import os
import signal
import time
from concurrent.futures import Future

import pytest

from kiln.checkpoint.saver import CheckpointSaver, _InFlight
from kiln.config import JobConfig, validate
from kiln.errors import ConfigError
from kiln.resilience import PreemptionFlag
from kiln.resilience.preemption import Preempted
from kiln.resilience.time_limit import TimeLimit, process_started


def test_first_ctrl_c_asks_for_a_checkpoint_the_second_aborts(capfd):
    # What was there before: a job started in the background of a shell ignores SIGINT.
    before = signal.getsignal(signal.SIGINT)
    flag = PreemptionFlag()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs in the main thread at the next bytecode
        assert flag.received == "SIGINT"
        assert "Ctrl-C again aborts at once" in capfd.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_an_interrupted_run_exits_130_and_says_where_it_resumes(tmp_path):
    stop = Preempted(signal_name="SIGINT", step=7, checkpoint=tmp_path / "step_00000007")
    assert stop.exit_code == 130 and "resume from step 7" in str(stop)
    assert Preempted(signal_name="SIGTERM", step=7, checkpoint=None).exit_code == 75


def test_the_time_limit_keeps_room_for_two_steps_and_a_checkpoint():
    limit = TimeLimit(1, started=time.monotonic() - 50)  # about 10 s left
    assert not limit.expiring(step_seconds=2, save_seconds=5)  # 9 s needed
    assert limit.expiring(step_seconds=3, save_seconds=5)  # 11 s needed
    assert not TimeLimit(1, started=time.monotonic() - 50, enabled=False).expiring(
        step_seconds=30, save_seconds=30
    )  # only rank 0 decides
    assert not TimeLimit(0).expiring(step_seconds=1e9, save_seconds=1e9)  # no limit


def test_a_stop_with_a_save_in_flight_budgets_its_rest_and_one_more_save(tmp_path):
    """A stop waits for the save in flight, then saves its own step: both count."""
    saver = CheckpointSaver(tmp_path)
    saver.last_seconds = 4.0
    assert saver.stop_seconds() == 4.0  # nothing in flight: one save
    unfinished = Future()
    saver.in_flight = _InFlight(1, unfinished, time.monotonic() - 1.0, 0.1, own_files=[])
    # 3 s left of a save as long as the last (4 s, begun 1 s ago), then a 4 s save: 7 s, less
    # the instants between the two clock reads.
    assert 6.9 < saver.stop_seconds() <= 7.0
    unfinished.set_result(None)
    assert saver.stop_seconds() == 4.0  # written: only the commit is left


def test_the_limit_counts_from_the_start_of_the_process():
    assert 0 < time.monotonic() - process_started() < 3600


def test_bad_stop_settings_name_the_key_and_the_fix():
    cfg = JobConfig()
    cfg.train.stop_at_step, cfg.train.time_limit_minutes = 500, -1
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    assert "train.stop_at_step (500) must be in [0, train.max_steps = 100]" in str(error.value)
    assert "raise train.max_steps" in str(error.value)
    assert "train.time_limit_minutes must be >= 0" in str(error.value)
