"""The core layouts on stock gloo: the transport kiln's CPU runs take. The other parity suites'
gang jobs run their collectives through the test suite's shared-memory arena
(tests/support/accelerator.py), which is faster on two cores; here FSDP, HSDP, tensor, pipeline,
expert and context parallel each run once more without it, the cheapest case of each suite where
the arena would carry something (FSDP's units or the tp groups; for ep and cp, whatever their
runs shard), and are held to the same parity with one process: 10 steps, the same tolerances.
"""

import pytest

from tests.distributed import (
    test_context_parallel,
    test_expert_parallel,
    test_parity,
    test_pipeline,
)
from tests.distributed.parity import GLOBAL_BATCH, assert_parity, records


def dense(layouts, name):
    nproc, overrides, model = layouts[name]
    return nproc, (*overrides, *model), model


CASES = {
    "FSDP dp_shard=2": dense(test_parity.LAYOUTS, "dp_shard=2"),
    "HSDP dp_replicate=2 x dp_shard=2": dense(test_parity.LAYOUTS, "dp_replicate=2 x dp_shard=2"),
    "TP tp=2": dense(test_parity.LAYOUTS, "tp=2, sliding window and sinks"),
    "PP pp=2 x dp_shard=2": dense(test_pipeline.LAYOUTS, "pp=2 x dp_shard=2"),
    "CP cp=2": (*test_context_parallel.LAYOUTS["cp=2"], ()),
}


@pytest.mark.parametrize("layout", CASES, ids=list(CASES))
def test_layout_on_gloo_matches_one_process(layout, references, runs):
    nproc, overrides, model = CASES[layout]
    batch = (
        [] if any("batch_size" in o for o in overrides) else [f"--train.batch_size={GLOBAL_BATCH}"]
    )
    got = records(runs(nproc, *batch, *overrides, shared_memory=False))
    assert_parity(got, references(*model))


def test_expert_parallel_on_gloo_matches_one_process(runs):
    nproc, overrides, router, reference_overrides = test_expert_parallel.LAYOUTS["ep=2"]
    got = records(runs(nproc, *overrides, *router, shared_memory=False))
    expected = records(runs(1, *reference_overrides, *router))
    test_expert_parallel.assert_expert_parallel_parity(got, expected)
