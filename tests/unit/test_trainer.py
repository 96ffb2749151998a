import json

import pytest
import torch

from kiln.config import load_config
from kiln.data.loader import StepBatch
from kiln.errors import ConfigError
from kiln.train.trainer import Trainer
from tests.conftest import DEBUG_CONFIG


def make_trainer(overrides, *extra):
    return Trainer(
        load_config(DEBUG_CONFIG, [*overrides, "--checkpoint.interval=0", *extra], world_size=1)
    )


@pytest.mark.parametrize(("batch_size", "accum"), [(2, 2), (1, 4)])
def test_grad_accumulation_matches_one_big_batch(debug_overrides, tmp_path, batch_size, accum):
    """Same global batch, split into micro-batches: same losses and gradient norms step by step."""
    reference = make_trainer(debug_overrides, "--train.batch_size=4", "--train.grad_accum_steps=1")
    split = make_trainer(
        debug_overrides,
        f"--metrics.run_dir={tmp_path / 'split'}",
        f"--train.batch_size={batch_size}",
        f"--train.grad_accum_steps={accum}",
    )
    for _ in range(10):
        loss_a, norm_a, *_ = reference.train_step()
        loss_b, norm_b, *_ = split.train_step()
        assert loss_b.item() == pytest.approx(loss_a.item(), rel=1e-5)
        assert norm_b.item() == pytest.approx(norm_a.item(), rel=1e-5)


def test_loss_is_normalized_by_the_valid_tokens_of_the_whole_step(debug_overrides):
    """Masked tokens spread unevenly over micro-batches must not reweight the others."""
    whole = make_trainer(debug_overrides, "--train.batch_size=4", "--train.grad_accum_steps=1")
    split = make_trainer(debug_overrides, "--train.batch_size=1", "--train.grad_accum_steps=4")
    batch = whole.loader.next_step()
    ((inputs, labels),) = batch.micro_batches
    labels = labels.clone()
    labels[0, :100] = -100  # sample 0 mostly masked, the others not at all
    whole.loader.next_step = lambda: StepBatch([(inputs, labels)], batch.dataset_ids)
    split.loader.next_step = lambda: StepBatch(
        [(inputs[i : i + 1], labels[i : i + 1]) for i in range(4)],
        [ids[i : i + 1] for ids in batch.dataset_ids for i in range(4)],
    )
    loss_a, norm_a, *_ = whole.train_step()
    loss_b, norm_b, *_ = split.train_step()
    assert loss_b.item() == pytest.approx(loss_a.item(), rel=1e-6)
    assert norm_b.item() == pytest.approx(norm_a.item(), rel=1e-5)


# A batch ramp and a sequence-length phase (docs/configuration.md): two sequences per micro-batch
# and two micro-batches at the full batch; the ramp grows the batch from 2 to 4 sequences over
# 1,536 tokens, while the first 768 tokens are read at half length. On one rank, steps 1-3 are
# the phase, the ramp adds the second micro-batch at step 7 (tests/unit/test_training_schedule.py).
RAMP = ("--train.batch_schedule.tokens=[0, 1536]", "--train.batch_schedule.sequences=[2, 4]")
PHASE = ("--train.seq_len_schedule=[{seq_len=64, until_tokens=768}]",)
SCHEDULED = ("--train.batch_size=2", "--train.grad_accum_steps=2", *RAMP, *PHASE)


@pytest.mark.parametrize(
    "schedule", [(), (*SCHEDULED, "--scheduler.unit=tokens")], ids=["fixed", "ramp and phase"]
)
def test_resume_is_bitwise_identical(debug_overrides, tmp_path, schedule):
    """Saved at step 3 and resumed: the same losses bitwise; with the schedules, the phase's
    end (step 4) and the ramp's step up (step 7) fall inside the resumed steps."""
    uninterrupted = make_trainer(debug_overrides, "--train.max_steps=8", *schedule)
    expected = [uninterrupted.train_step()[0].item() for _ in range(8)]

    run = [f"--metrics.run_dir={tmp_path / 'interrupted'}", "--train.max_steps=8", *schedule]
    first = make_trainer(debug_overrides, *run)
    for _ in range(3):
        first.train_step()
    first.save()
    first.train_step()  # progress past the checkpoint is lost, as in a crash
    del first

    second = make_trainer(debug_overrides, *run)
    assert second.step == 3
    resumed = [second.train_step()[0].item() for _ in range(5)]
    assert resumed == expected[3:]


def test_resume_never_refuses_a_folder_with_checkpoints(debug_overrides):
    make_trainer(debug_overrides, "--train.max_steps=6").train()
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        make_trainer(debug_overrides, "--train.max_steps=6", "--checkpoint.resume=never")


def test_metrics_jsonl_and_plot(debug_overrides, tmp_path):
    trainer = make_trainer(debug_overrides, "--train.max_steps=6", "--metrics.log_interval=2")
    trainer.train()
    run_dir = tmp_path / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 4, 6]
    for key in (
        "step",
        "loss",
        "grad_norm",
        "lr",
        "tokens_seen",
        "tokens_per_sec",
        "mfu",
        "peak_mem_gb",
    ):
        assert key in records[-1]
    assert records[-1]["tokens_seen"] == 6 * 4 * 128
    assert records[-1]["mfu"] is None and records[-1]["peak_mem_gb"] is None  # CPU
    assert (run_dir / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "config.toml").is_file()
    assert (run_dir / "checkpoints" / "step_00000006" / "COMPLETE").is_file()


def test_loss_falls_on_the_demo_corpus(debug_overrides):
    trainer = make_trainer(debug_overrides, "--train.max_steps=30", "--metrics.log_interval=30")
    first = trainer.train_step()[0].item()
    for _ in range(29):
        last = trainer.train_step()[0].item()
    assert last < 0.85 * first
    assert torch.isfinite(torch.tensor(last))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_step_reports_mfu_and_memory(debug_overrides):
    trainer = make_trainer(debug_overrides, "--train.max_steps=3", "--train.device=cuda")
    record = trainer.train()[-1]
    assert record["peak_mem_gb"] > 0
    assert (
        record["mfu"] is None or 0 < record["mfu"] < 1
    )  # None on a GPU missing from the peak table
