"""Fixtures of the parity suites: gangs of worker processes that run `kiln train` jobs, and the
one-process reference runs, one per model variant, computed on first use."""

import pytest

from tests.distributed.parity import STEPS, records, reference_args, train_args
from tests.distributed.workers import Gangs, kiln_train


@pytest.fixture(scope="session")
def gangs(tmp_path_factory):
    gangs = Gangs(tmp_path_factory.mktemp("gangs"))
    yield gangs
    gangs.close()


@pytest.fixture(scope="session")
def train(gangs, demo_data):
    """train(run_dir, nproc, *overrides, steps=STEPS, mutation=None, shared_memory=True):
    `kiln train` with the parity arguments on `nproc` ranks of a gang; returns each rank's
    output. `mutation`: one of tests/support/mutations.py, for this job only; `shared_memory`
    False: the job's collectives on stock gloo, as kiln's own CPU runs, not the test suite's
    arena."""

    def run(run_dir, nproc, *overrides, steps=STEPS, mutation=None, shared_memory=True):
        args = train_args(run_dir, demo_data, *overrides, steps=steps)
        return gangs.run(nproc, kiln_train, args, mutation=mutation, shared_memory=shared_memory)

    return run


@pytest.fixture(scope="session")
def runs(tmp_path_factory, train):
    """runs(nproc, *overrides, shared_memory=True): the run dir of a parity run of STEPS steps,
    trained once per session. A layout's test and a test that resumes from (a copy of) its
    checkpoints share it; treat it as read-only. `shared_memory` False: on stock gloo."""
    cache = {}

    def get(nproc, *overrides, shared_memory=True):
        key = nproc, overrides, shared_memory
        if key not in cache:
            run_dir = tmp_path_factory.mktemp("run") / "run"
            train(run_dir, nproc, *overrides, shared_memory=shared_memory)
            assert sorted(records(run_dir)) == list(range(1, STEPS + 1))
            cache[key] = run_dir
        return cache[key]

    return get


@pytest.fixture(scope="session")
def references(runs):
    """references(*model_overrides): the records of one process on the global batch."""
    return lambda *model_overrides: records(runs(*reference_args(*model_overrides)))


@pytest.fixture(scope="session")
def reference(references):
    return references()
