"""The shared-memory arena of the test suite's CPU collectives (tests/support/
shared_memory_collectives.py): a buffer that does not fit, or whose file cannot be made, is
refused at creation, with the size and the reason, and leaves no file behind (so the group falls
back to gloo instead of dying of SIGBUS when it first writes past what /dev/shm holds). A waiting
rank polls only while the whole machine, not just its own job, leaves it a core."""

import glob
import os
import tempfile

import pytest

from tests.support import shared_memory_collectives as shm


def own_files() -> set[str]:
    return set(glob.glob(f"/dev/shm/{shm.FILE_PREFIX}{os.getpid()}-*"))


def test_a_buffer_that_does_not_fit_is_refused_and_leaves_no_file():
    before = own_files()
    answer = shm._create_buffer_file(2**60)
    assert answer.startswith("error: 1099511627776 MiB in "), answer
    assert own_files() == before


def test_a_file_that_cannot_be_made_is_refused(monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "mkstemp", full)
    answer = shm._create_buffer_file(4096)
    assert answer.startswith("error: no file in ") and "No space left" in answer, answer


def test_a_buffer_that_fits_is_reserved_in_full():
    path = shm._create_buffer_file(3 * 2**20)
    try:
        assert os.path.basename(path).startswith(f"{shm.FILE_PREFIX}{os.getpid()}-"), path
        assert os.stat(path).st_blocks * 512 >= 3 * 2**20  # allocated, not a sparse file
    finally:
        os.unlink(path)


@pytest.mark.parametrize(
    ("job_threads", "loadavg", "poll"),
    [
        (2, "1.00 0.50 0.20 2/300 4242", True),  # the job's two ranks, nothing else
        (2, "3.00 2.00 1.00 5/300 4242", False),  # another job's threads want the cores too
        (4, "1.00 0.50 0.20 1/300 4242", False),  # the job alone has more threads than cores
        (2, "", True),  # no /proc/loadavg: the job's own threads decide
    ],
)
def test_polling_needs_a_core_for_every_runnable_thread_on_the_machine(job_threads, loadavg, poll):
    load = shm.MachineLoad(job_threads, cores=2, read_loadavg=lambda: loadavg)
    assert load.may_poll() is poll


def test_the_load_is_looked_at_again(monkeypatch):
    readings = iter(["0 0 0 1/9 1", "0 0 0 7/9 1"])
    load = shm.MachineLoad(1, cores=2, read_loadavg=lambda: next(readings))
    clock = iter([100.0, 100.01, 100.5])
    monkeypatch.setattr(shm.time, "monotonic", lambda: next(clock))
    assert load.may_poll() and load.may_poll()  # the second within LOAD_CHECK_S: not read
    assert not load.may_poll()  # another job started meanwhile
