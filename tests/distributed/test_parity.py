"""Parity: every data-parallel and tensor-parallel layout reproduces one process.

Compiled blocks are checked in test_moe_parity.py on the debug_moe model, whose first block is a
dense Llama block and the next an MoE block: one run compiles both kinds (a cold compile costs
about 30 s per kind of block on two cores)."""

import os
import subprocess
import sys

import pytest

from tests.distributed.parity import (
    SAVE,
    STEPS,
    WINDOWED,
    assert_parity,
    copy_to_resume,
    records,
    train_args,
)
from tests.distributed.workers import free_port

KV4 = ("--model.n_kv_heads=4",)  # tp=4 needs the KV heads to split four ways
TIED = ("--model.tie_embeddings=true",)
# Qwen3-shaped (docs/models.md): 4 heads of 48 on dim 128 (queries 192 wide), per-head q/k norms
# whose weights are shared by heads split over tp, tied embeddings. At the debug recipe's lr
# (3e-3) tied embeddings make steps 6-10 ill-conditioned: one process summing its batch of 8
# whole or as two accumulated halves already differs by up to 5.7e-6 in a per-parameter norm
# (1e-7 untied), which layouts turn into 1.6e-5; at lr 1e-3 the two differ by at most 8.6e-7
# (measured on the demo corpus), so 1e-5 tells a real mistake from rounding again.
QWEN3 = (
    "--model.head_dim=48",
    "--model.qk_norm=true",
    "--model.tie_embeddings=true",
    "--optimizer.lr=1e-3",
)

# A batch ramp and a sequence-length phase (docs/configuration.md), carried by the layouts with
# one micro-batch of 4 sequences over the data ranks (dp_shard=4, dp=2/accum=2,
# tp=2 x dp_shard=2) and by the one process they match: its batch settings come first in a
# layout's overrides, so the layout's own win. Steps 1-2 read 8 sequences of 32 tokens, steps 3-6
# one micro-batch of 4 × 64 (the ramp's 4 + 4 · t / 1536 rounds down to 4), steps 7-10 two:
# each step's global batch and shape change once in the run's 10 steps, and the schedule's
# learning rate runs over tokens.
SCHEDULES = (
    "--train.batch_size=4",
    "--train.grad_accum_steps=2",
    "--train.batch_schedule.tokens=[0, 1536]",
    "--train.batch_schedule.sequences=[4, 8]",
    "--train.seq_len_schedule=[{seq_len=32, until_tokens=512}]",
    "--scheduler.unit=tokens",
)

LAYOUTS = {
    "dp_shard=2": (2, ["--distributed.dp_shard=2", "--train.batch_size=4"], ()),
    # Saves checkpoints: test_checkpoint_from_one_layout_resumes_in_another continues them.
    "dp_shard=4, ramp and phase": (
        4,
        ["--distributed.dp_shard=4", "--train.batch_size=1", SAVE],
        SCHEDULES,
    ),
    "dp_shard=8": (8, ["--distributed.dp_shard=8", "--train.batch_size=1"], ()),
    "dp_replicate=2 x dp_shard=2": (
        4,
        ["--distributed.dp_replicate=2", "--distributed.dp_shard=2", "--train.batch_size=2"],
        (),
    ),
    "dp_shard=2, blocks kept gathered, Qwen3-shaped": (
        2,
        ["--train.batch_size=4", "--distributed.reshard_after_forward=false"],
        QWEN3,
    ),
    "dp_shard=2, full AC, sliding window and sinks": (
        2,
        ["--train.batch_size=4", "--train.activation_checkpointing=full"],
        WINDOWED,
    ),
    "dp_replicate=2 x dp_shard=2, selective AC": (
        4,
        [
            "--distributed.dp_replicate=2",
            "--train.batch_size=2",
            "--train.activation_checkpointing=selective",
        ],
        (),
    ),
    "dp=4/accum=1": (4, ["--train.batch_size=2", "--train.grad_accum_steps=1"], ()),
    "dp=2/accum=2, ramp and phase": (2, ["--train.batch_size=2"], SCHEDULES),
    "dp=1/accum=4": (1, ["--train.batch_size=2", "--train.grad_accum_steps=4"], ()),
    "dp=2/accum=2, one reduce per step": (
        2,
        [
            "--train.batch_size=2",
            "--train.grad_accum_steps=2",
            "--distributed.grad_reduce=per_step",
        ],
        (),
    ),
    "tp=2, sliding window and sinks": (2, ["--distributed.tp=2", "--train.batch_size=8"], WINDOWED),
    "tp=4": (4, ["--distributed.tp=4", "--train.batch_size=8"], KV4),
    "tp=2, tied embeddings": (2, ["--distributed.tp=2", "--train.batch_size=8"], TIED),
    "tp=2 x dp_shard=2, Qwen3-shaped": (4, ["--distributed.tp=2", "--train.batch_size=4"], QWEN3),
    "tp=2 x dp_shard=2, accum=2, ramp and phase": (
        4,
        ["--distributed.tp=2", "--train.batch_size=2"],
        SCHEDULES,
    ),
    "tp=2 x dp_shard=2, full AC": (
        4,
        ["--distributed.tp=2", "--train.batch_size=4", "--train.activation_checkpointing=full"],
        (),
    ),
    "tp=2 x dp_replicate=2 x dp_shard=2": (
        8,
        ["--distributed.tp=2", "--distributed.dp_replicate=2", "--train.batch_size=2"],
        (),
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_layout_matches_one_process(layout, references, runs):
    nproc, overrides, model = LAYOUTS[layout]
    assert_parity(records(runs(nproc, *model, *overrides)), references(*model))


def test_checkpoint_from_one_layout_resumes_in_another(references, runs, train, tmp_path):
    """Saved under FSDP by 4 ranks (the dp_shard=4 run), resumed in one process at step 6, at
    another data-parallel size during the batch ramp (its step up at step 7): the rest of the run
    still matches."""
    nproc, overrides, model = LAYOUTS["dp_shard=4, ramp and phase"]
    run = tmp_path / "run"
    step_5 = copy_to_resume(runs(nproc, *model, *overrides), run)
    assert len(list(step_5.glob("*.distcp"))) == 4  # written by the four ranks
    (output,) = train(run, 1, *model)
    assert f"kiln: resumed from {step_5} (step 5)" in output
    assert_parity(records(run), references(*model), steps=range(6, STEPS + 1))


def test_two_node_job_on_one_machine(reference, tmp_path, demo_data):
    """Two torchrun agents (`--nnodes 2`) rendezvous on 127.0.0.1 and train as one job: the real
    launch path of `torchrun ... -m kiln train`, which the gangs do not go through."""
    run_dir = tmp_path / "run"
    args = train_args(run_dir, demo_data, "--train.batch_size=4")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    launcher += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    launcher += ["--rdzv-id=kiln-two-nodes"]
    agents = [
        subprocess.Popen(
            [*launcher, f"--node-rank={node}", "-m", "kiln", "train", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), "\n".join(o[-3000:] for o in outputs)
    assert_parity(records(run_dir), reference)
