"""The reads of device memory by the host in a training step that is not logged, counted.

On a GPU each such read (`.item()`, `.tolist()`, `if tensor`, `float(tensor)`, ...) makes the
host wait until the device has run everything queued, and the device then idles while the host
queues the next work. On the CPU no read waits, so they are counted here by wrapping
torch.Tensor's reading methods for one `trainer.train_step()` (one process, as
tests/unit/test_trainer.py builds the trainer). A read added to the step fails this test with
where it is. Reads inside torch's C++ ops (`nonzero`, boolean indexing) are not seen here:
tests/gpu/test_host_syncs.py counts the same step with CUDA's sync debug mode.
"""

from __future__ import annotations

import contextlib
import math
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kiln.config import load_config
from kiln.train.trainer import Trainer
from tests.conftest import DEBUG_CONFIG, REPO

MOE_CONFIG = REPO / "configs" / "train" / "debug_moe.toml"
READS = (
    "item",
    "tolist",
    "numpy",
    "cpu",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__complex__",
    "__array__",
)
KILN = str(REPO / "kiln")

# Each read a non-logging step makes, by where kiln makes it, and why the step needs it.
EXPECTED = {
    # The NaN guard acts at the step whose loss or gradient norm is not finite (skip the update,
    # or stop or roll back after resilience.nan_max_consecutive in a row): the host must know it
    # before the update. One read of the flag (with the other ranks' agreed flags when there
    # are several).
    "__bool__ at kiln/train/step.py:_agree": 1,
}
# With loss-spike skipping on (resilience.spike_action): the step's loss and gradient norm, which
# the detector judges before the update; the NaN guard reads its finiteness from them.
SPIKES = {"tolist at kiln/train/step.py:_spike_check": 1}


def kiln_caller() -> str:
    """'kiln/x.py:function' of the innermost kiln frame that led to this read."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(KILN):
            return f"{Path(frame.filename).relative_to(REPO)}:{frame.name}"
    return "outside kiln"


@contextlib.contextmanager
def counted_reads(host_tensors: set[int]) -> Iterator[Counter]:
    """Count torch.Tensor's reads while inside, by kiln caller; `host_tensors` (ids) are tensors
    that live on the host even on a GPU, whose reads wait for nothing."""
    reads: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name: str):
        original = originals[name]

        def read(self, *args, **kwargs):
            if id(self) not in host_tensors:
                reads[f"{name} at {kiln_caller()}"] += 1
            return original(self, *args, **kwargs)

        return read

    try:
        for name in READS:
            setattr(torch.Tensor, name, counting(name))
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def optimizer_steps(trainer: Trainer) -> set[int]:
    """AdamW's step counts: torch keeps them on the host unless the update is fused (kiln's is
    fused on CUDA, where none is read), and reads them there on the CPU."""
    return {
        id(state["step"])
        for part in trainer.optimizers
        for optimizer in part
        for state in optimizer.state.values()
        if "step" in state
    }


@pytest.mark.parametrize(
    ("config", "extra", "expected"),
    [
        # Per-parameter gradient norms on: taken every step, read only when logged.
        (DEBUG_CONFIG, ["--metrics.param_grad_norms=true"], EXPECTED),
        # Balancing on: the bias update, the idle-expert counts and the MoE records.
        (
            MOE_CONFIG,
            ["--model.moe.bias_update_rate=0.001", "--metrics.idle_expert_warn_steps=1"],
            EXPECTED,
        ),
        (DEBUG_CONFIG, ["--resilience.spike_action=skip"], SPIKES),
    ],
    ids=["dense", "moe", "spike_skipping"],
)
def test_a_step_that_is_not_logged_reads_only_what_it_needs(
    debug_overrides, config, extra, expected
):
    cfg = load_config(config, [*debug_overrides, "--checkpoint.interval=0", *extra], world_size=1)
    trainer = Trainer(cfg)
    trainer.train_step()  # the first step creates the optimizer state
    with counted_reads(optimizer_steps(trainer)) as reads:
        result = trainer.train_step()
    assert dict(reads) == expected, "a non-logging step reads the device where it did not"
    # What a logged step reads afterwards is still there and right.
    records = trainer.step_fn.records()
    if result.param_grad_norms is not None:
        norms = result.param_grad_norms.read()
        total = math.sqrt(sum(value**2 for value in norms.values()))
        # fp64 sums of the same squares in two orders: rounding only.
        assert total == pytest.approx(result.grad_norm.item(), rel=1e-9)
    elif config == MOE_CONFIG:
        assert any(name.startswith("moe/load/") for name in records)
