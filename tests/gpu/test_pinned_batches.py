"""The loader's batches on CUDA are in pinned (page-locked) host memory (kiln/data/loader.py), as
the trainer asks for on a GPU; on the CPU they are not (tests/unit/test_loader.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.runs import DEBUG_RECIPE, make_trainer


@pytest.mark.cuda_only("pinned host memory is page-locked for CUDA copies")
def test_training_batches_are_pinned(device: torch.device, demo_data: Path, tmp_path: Path) -> None:
    # One loader worker process, as a run's default: the batch crosses from it, then is pinned.
    trainer = make_trainer(
        DEBUG_RECIPE, device, tmp_path / "run", demo_data, "--data.num_workers=1"
    )
    assert trainer.loader.pin_memory
    batch = trainer.loader.next_step()
    for inputs, labels in batch.micro_batches:
        assert inputs.is_pinned() and labels.is_pinned()
    assert trainer.train_step().finite  # and the step trains on them
