"""The NaN guard on the device (kiln/resilience/nan_guard.py, kiln/train/step.py): a step whose
loss or gradient norm is not finite (here made NaN by `resilience.debug_nan_steps`, which
multiplies the loss by NaN so the gradients are NaN too) changes no weight and no optimizer
state; after `nan_max_consecutive` such steps in a row the run stops with its message. On CUDA
the finiteness test is a device tensor the step reads once, with its other flags."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kiln.errors import KilnError
from kiln.events import read_events
from kiln.train.trainer import Trainer
from tests.gpu.runs import DEBUG_RECIPE, make_trainer


def snapshot(trainer: Trainer) -> list[torch.Tensor]:
    """Every weight and every optimizer state tensor, copied."""
    (model,) = trainer.model_parts
    tensors = [p.detach().clone() for p in model.parameters()]
    for optimizer in trainer.optimizers[0]:
        for state in optimizer.state.values():
            tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def test_a_non_finite_step_changes_nothing(
    device: torch.device, demo_data: Path, tmp_path: Path
) -> None:
    trainer = make_trainer(
        DEBUG_RECIPE, device, tmp_path / "run", demo_data, "--resilience.debug_nan_steps=[3]"
    )
    for _ in range(2):
        assert trainer.train_step().finite
    before = snapshot(trainer)
    result = trainer.train_step()
    assert not result.finite
    assert math.isnan(result.loss.item()) and math.isnan(result.grad_norm.item())
    after = snapshot(trainer)
    # Exact: a skipped step only drops the gradients; the optimizer never ran on the NaNs.
    assert len(before) == len(after)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    result = trainer.train_step()  # the next step trains again, from the same state
    assert result.finite and math.isfinite(result.loss.item())
    assert not all(torch.equal(a, b) for a, b in zip(before, snapshot(trainer), strict=True))


def test_too_many_non_finite_steps_stop_the_run(
    device: torch.device, demo_data: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    trainer = make_trainer(
        DEBUG_RECIPE,
        device,
        run_dir,
        demo_data,
        "--train.max_steps=6",
        "--metrics.log_interval=1",
        "--resilience.debug_nan_steps=[2, 4, 5]",
        "--resilience.nan_max_consecutive=2",
    )
    with pytest.raises(KilnError, match="2 steps in a row up to step 5 had a non-finite loss"):
        trainer.train()
    skips = [e["step"] for e in read_events(run_dir) if e["event"] == "nan_skip"]
    assert skips == [2, 4, 5]
    assert trainer.nan_guard.skipped_total == 3
