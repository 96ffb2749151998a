"""Streaming as users run it: two data ranks under torchrun each read their share of a Hugging
Face dataset, the checkpoint keeps both positions, and one process continues the run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import datasets

from kiln.config import load_config
from kiln.train.trainer import Trainer
from tests.conftest import DEBUG_CONFIG


def test_two_streaming_ranks_save_both_positions_and_one_process_continues(
    tmp_path, demo_data, capsys
):
    texts = [f"def f{i}(a):\n    return a + {i}\n" * (1 + i % 7) for i in range(400)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(tmp_path / "saved")
    run = [
        str(DEBUG_CONFIG),
        "--data.source=hf",
        f"--data.path={tmp_path / 'saved'}",
        f"--data.tokenizer={demo_data / 'tokenizer.json'}",
        "--data.streaming=true",
        "--train.seq_len=32",
        "--checkpoint.interval=2",
        "--train.max_steps=6",
        "--scheduler.warmup_steps=1",
        f"--metrics.run_dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    two = subprocess.run(
        [*launcher, "-m", "kiln", "train", *run, "--train.stop_at_step=2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    state = json.loads(next((tmp_path / "run").rglob("step_00000002/train_state.json")).read_text())
    positions = state["streams"]["data"]["positions"]
    assert state["streams"]["data"]["ranks"] == 2 and len(positions) == 2
    assert [p["document"] % 2 for p in positions] == [0, 1]  # each rank in its own share
    # The same global batch on one rank: two micro-batches where there were two ranks.
    one = Trainer(load_config(DEBUG_CONFIG, [*run[1:], "--train.grad_accum_steps=2"], world_size=1))
    assert one.step == 2
    assert "saved by 2 data rank(s), continued on 1" in capsys.readouterr().out
    losses = [one.train_step()[0].item() for _ in range(2)]
    assert all(math.isfinite(loss) for loss in losses)
