"""The training step with an MoE model: auxiliary losses normalized over the step and bias
updates from the step's counts, so micro-batching does not change training."""

import pytest
import torch

from kiln.config import load_config
from kiln.train.moe_step import MoEBalancing
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
        "--model.moe.aux_loss_weight=0.0",
        "--model.moe.seq_aux_loss_weight=0.01",
        "--model.moe.bias_update_rate=0.01",
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
    (balancing,) = [hook for hook in whole.step_fn.hooks if isinstance(hook, MoEBalancing)]
    for step in (1, 2, 3):
        loss_a, norm_a, *_ = whole.train_step()
        loss_b, norm_b, *_ = split.train_step()
        assert loss_b.item() == pytest.approx(loss_a.item(), rel=1e-5)
        assert norm_b.item() == pytest.approx(norm_a.item(), rel=1e-5)
        # debug_moe logs step 1 (and every 5th): only a logged step's forwards compute every
        # balancing loss for the records, the others only the weighted one, and keep none.
        sums = balancing.step.aux_loss_sums
        assert bool(sums.all()) if step == 1 else not sums.any()
    biases = expert_biases(whole)
    assert any(b.abs().sum() > 0 for b in biases)
    for a, b in zip(biases, expert_biases(split), strict=True):
        assert torch.equal(a, b)


def test_expert_load_is_logged_and_idle_experts_are_named(debug_overrides, tmp_path, capsys):
    """64 experts, top 1, 16 tokens a step: most experts get no token. With a patience of 2 an
    idle expert is named once, at the step its stretch reaches 2 (zero at that step and the one
    before, not at the one before that); every logged step records each MoE layer's
    per-expert fractions of the assignments."""
    trainer = make_trainer(
        debug_overrides,
        "--model.moe.num_experts=64",
        "--model.moe.top_k=1",
        "--train.seq_len=16",
        "--train.batch_size=1",
        "--train.max_steps=3",
        "--metrics.log_interval=1",
        "--metrics.idle_expert_warn_steps=2",
    )
    records = trainer.train()
    warned = [line for line in capsys.readouterr().err.splitlines() if "received no token" in line]
    (layer,) = [name for name in records[0] if name.startswith("moe/load/")]
    idle = [[fraction == 0 for fraction in record[layer]] for record in records]
    reaching_2 = [
        expert
        for step in (1, 2)
        for expert in range(64)
        if idle[step][expert] and idle[step - 1][expert] and not (step == 2 and idle[0][expert])
    ]
    assert len(warned) == len(reaching_2) >= 40
    assert "has received no token for 2 steps in a row" in warned[0]
    for record in records:
        assert len(record[layer]) == 64 and sum(record[layer]) == pytest.approx(1.0)
