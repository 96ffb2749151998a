"""Jobs started by hand, one process per rank (RANK, WORLD_SIZE, MASTER_ADDR), for tests that
must see what kiln itself does when signalled, killed or stopped: no launcher in between."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import DEBUG_CONFIG


def env() -> dict[str, str]:
    """One thread per process: several ranks share two cores."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def kiln_args(run_dir: Path, demo_data: Path, *overrides: str) -> list[str]:
    return [
        str(DEBUG_CONFIG),
        f"--data.path={demo_data}",
        f"--metrics.run_dir={run_dir}",
        "--metrics.log_interval=1",
        "--metrics.plot=false",
        "--train.seq_len=64",
        "--checkpoint.save_final=false",
        *overrides,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(
    nproc: int, args: list[str], logs: Path, *, module: str = "kiln"
) -> list[subprocess.Popen]:
    """`nproc` ranks of one job without a launcher (`python -m MODULE train ARGS`), each logging
    to logs/rank_R.txt."""
    logs.mkdir(parents=True, exist_ok=True)
    common = {
        **env(),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nproc),
    }
    return [
        subprocess.Popen(
            [sys.executable, "-m", module, "train", *args],
            env={**common, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=(logs / f"rank_{r}.txt").open("w"),
            stderr=subprocess.STDOUT,
        )
        for r in range(nproc)
    ]


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"ranks still running after {timeout} s") from None
    return codes


def wait_for_step(run_dir: Path, step: int, procs, timeout: float = 120) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file() and any(
            json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()
        ):
            return
        assert all(p.poll() is None for p in procs), "the job ended before the signal"
        time.sleep(0.02)
    raise AssertionError(f"step {step} never logged")


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def log(logs: Path, rank: int = 0) -> str:
    return (logs / f"rank_{rank}.txt").read_text()
