"""NCCL, the CUDA collectives: `kiln train` on one GPU under torchrun with a one-rank NCCL
process group and FSDP over it (tests/gpu/one_rank_fsdp.py), against the same run in one plain
process. On the CPU (the dry run) the same group is gloo, which tests/distributed covers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.runs import DEBUG_RECIPE, read_records, run_command

DRIVER = Path(__file__).resolve().parent / "one_rank_fsdp.py"
STEPS = 8
# fp32 on both sides. FSDP over one rank gathers and reduces by copying, so the arithmetic is
# the same; what may differ is the order of a few sums (the gradient norm over the DTensor
# shards) and attention's backward, whose fp32 kernel adds its partial sums in no fixed order.
# The parity tolerance of the CPU suites (tests/distributed/parity.py), 1e-5 relative, bounds
# that over 8 steps.
TOLERANCE = 1e-5


def train_args(run_dir: Path, data: Path, device: torch.device) -> list[str]:
    """`kiln train` arguments of both runs: the debug recipe, fp32, every step logged."""
    return [
        "train",
        str(DEBUG_RECIPE),
        f"--train.device={device.type}",
        f"--train.max_steps={STEPS}",
        f"--data.path={data}",
        f"--metrics.run_dir={run_dir}",
        "--data.num_workers=0",
        "--metrics.log_interval=1",
        "--metrics.plot=false",
        "--checkpoint.interval=0",
        "--checkpoint.save_final=true",  # a distributed checkpoint through the group, too
    ]


def test_one_rank_nccl_fsdp_trains_like_one_process(
    device: torch.device, demo_data: Path, tmp_path: Path
) -> None:
    plain_dir, fsdp_dir = tmp_path / "plain", tmp_path / "fsdp"
    run_command(
        [sys.executable, "-m", "kiln", *train_args(plain_dir, demo_data, device)],
        tmp_path / "plain.log",
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    output = run_command(
        [*torchrun, str(DRIVER), *train_args(fsdp_dir, demo_data, device)],
        tmp_path / "fsdp.log",
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    assert f"backend={backend}" in output
    units = [int(line.split("=")[1]) for line in output.splitlines() if "fsdp_units=" in line]
    assert units and units[0] > 0, output[-2000:]
    plain, fsdp = read_records(plain_dir), read_records(fsdp_dir)
    assert sorted(plain) == sorted(fsdp) == list(range(1, STEPS + 1))
    for step in plain:
        for key in ("loss", "grad_norm"):
            assert fsdp[step][key] == pytest.approx(plain[step][key], rel=TOLERANCE), (step, key)
    assert (fsdp_dir / "checkpoints" / f"step_{STEPS:08d}" / "COMPLETE").is_file()
