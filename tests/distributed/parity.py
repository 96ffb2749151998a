"""Helpers for parity runs (DESIGN §5): real `torchrun` jobs on CPU with gloo, fp32, the debug
model, 10 steps, the same global batch of 8 sequences, compared with one process step by step.
Gradient clipping at 0.5 is active most steps, so the clipped update is compared too."""

import json
import os
import shutil
import subprocess
import sys

from tests.conftest import DEBUG_CONFIG

STEPS = 10
GLOBAL_BATCH = 8
TOLERANCE = 1e-5


def train_args(run_dir, demo_data, *overrides, steps=STEPS):
    """`kiln train` arguments shared by every parity run."""
    args = [
        DEBUG_CONFIG,
        f"--data.path={demo_data}",
        f"--metrics.run_dir={run_dir}",
        f"--train.max_steps={steps}",
        "--metrics.log_interval=1",
        "--train.grad_clip_norm=0.5",
        "--checkpoint.interval=5",
        "--checkpoint.save_final=false",
        *overrides,
    ]
    return [*map(str, args)]


def train(tmp_path, name, demo_data, nproc, *overrides, steps=STEPS):
    run_dir = tmp_path / name
    args = train_args(run_dir, demo_data, *overrides, steps=steps)
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        if nproc > 1
        else []
    )
    command = [sys.executable, *launcher, "-m", "kiln", "train", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def records(run_dir):
    return {
        r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }


def assert_parity(got, expected, steps=range(1, STEPS + 1)):
    for step in steps:
        for key in ("loss", "grad_norm"):
            a, b = got[step][key], expected[step][key]
            assert abs(a - b) <= TOLERANCE * abs(b), f"step {step} {key}: {a} vs one process {b}"


def keep_only_first_checkpoint(run_dir):
    """Drop the step-10 checkpoint of a run saved at steps 5 and 10, so the next run resumes at 5."""
    checkpoints = run_dir / "checkpoints"
    shutil.rmtree(checkpoints / f"step_{STEPS:08d}")
    (checkpoints / "latest").unlink()
