"""The training step with an MoE model: auxiliary losses normalized over the step and bias
updates from the step's counts, so micro-batching does not change training."""

import pytest
import torch

from kiln.config import load_config
from kiln.train.trainer import Trainer
from tests.conftest import REPO

MOE_CONFIG = REPO / "configs" / "train" / "debug_moe.toml"


def make_trainer(overrides, *extra):
    return Trainer(
        load_config(MOE_CONFIG, [*overrides, "--checkpoint.interval=0", *extra], world_size=1)
    )


def expert_biases(trainer) -> list[torch.Tensor]:
    (model,) = trainer.model_parts
    return [b.clone() for name, b in model.named_buffers() if name.endswith("expert_bias")]


def test_micro_batches_train_like_one_batch(debug_overrides, tmp_path):
    # The sequence-wise and z losses are sums normalized over the step, and the bias update
    # uses the step's counts: splitting the batch changes neither. (The Switch loss takes f_e
    # from each micro-batch's counts, as without a count reduction it must, so it is off here.)
    moe = [
        "--model.moe_aux_loss_weight=0.0",
        "--model.moe_seq_aux_loss_weight=0.01",
        "--model.moe_bias_update_rate=0.01",
        "--train.seq_len=32",
    ]
    whole = make_trainer(debug_overrides, *moe, "--train.batch_size=4")
    split = make_trainer(
        debug_overrides,
        *moe,
        f"--metrics.run_dir={tmp_path / 'split'}",
        "--train.batch_size=2",
        "--train.grad_accum_steps=2",
    )
    for _ in range(3):
        loss_a, norm_a, *_ = whole.train_step()
        loss_b, norm_b, *_ = split.train_step()
        assert loss_b.item() == pytest.approx(loss_a.item(), rel=1e-5)
        assert norm_b.item() == pytest.approx(norm_a.item(), rel=1e-5)
    biases = expert_biases(whole)
    assert any(b.abs().sum() > 0 for b in biases)
    for a, b in zip(biases, expert_biases(split), strict=True):
        assert torch.equal(a, b)
