"""The host-device synchronizations of a training step that is not logged, counted by CUDA's
sync debug mode: the count tests/unit/test_host_syncs.py finds on the CPU from torch.Tensor's
reading methods, confirmed where a read really waits, with the synchronizations inside torch's
ops (`nonzero`, boolean indexing, a blocking copy) that no Python wrapper sees."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.gpu.runs import DEBUG_RECIPE, MOE_RECIPE, make_trainer
from tests.unit.test_host_syncs import EXPECTED

SYNC_WARNING = "called a synchronizing CUDA operation"


@pytest.mark.cuda_only("CUDA's sync debug mode counts synchronizations with a CUDA device")
# bf16, as GPU runs train: in fp32 torch's grouped_mm falls back to a loop over the experts
# that reads their offsets to the host, 3 waits a MoE layer forward and 6 backward (seen on an
# H200, torch 2.11); in bf16 it runs CUTLASS's grouped kernel, which takes the offsets on the device (to be confirmed on the next GPU).
@pytest.mark.parametrize("recipe", [DEBUG_RECIPE, MOE_RECIPE], ids=["dense", "moe"])
def test_a_step_that_is_not_logged_synchronizes_as_counted_on_the_cpu(
    device: torch.device, demo_data: Path, tmp_path: Path, recipe: Path
) -> None:
    bf16 = "--train.mixed_precision=bf16"
    trainer = make_trainer(recipe, device, tmp_path / "run", demo_data, bf16)
    trainer.train_step()  # the first step creates the optimizer state
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every synchronization, not once per place
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [
        f"{Path(w.filename).name}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)
    ]
    assert len(syncs) == sum(EXPECTED.values()), f"synchronizations at {syncs}"
