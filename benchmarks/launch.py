"""Run `kiln train` on the debug recipe (under torchrun for several ranks) and read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def train_records(ranks: int, *overrides: str, run_dir: Path, steps: int, data: str) -> list[dict]:
    """Train for `steps` steps, one thread per rank, no checkpoints; return metrics.jsonl."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        if ranks > 1
        else []
    )
    command = [
        sys.executable,
        *launcher,
        "-m",
        "kiln",
        "train",
        "configs/train/debug.toml",
        f"--data.path={data}",
        f"--metrics.run_dir={run_dir}",
        f"--train.max_steps={steps}",
        "--checkpoint.interval=0",
        "--checkpoint.save_final=false",
        "--metrics.plot=false",
        *overrides,
    ]
    subprocess.run(
        command, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
