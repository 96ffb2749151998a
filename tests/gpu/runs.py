"""The `kiln train` runs the GPU suite shares: one process each, started on first use, cached
for the session, so that one run serves several tests (the bf16 eager run serves the bf16 band,
the async resume and the metrics tests).

On CUDA the model is `llama3_125m` (126M parameters) at 8 × 1024 tokens for 16 steps, sized to
keep the whole suite within about 6 minutes on one H100 (compiling takes most of it); in the dry
run on the CPU the debug model at 4 × 128 tokens for 8 steps, to check the tests' own code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kiln.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "train" / "demo.toml"
DEBUG_RECIPE = REPO / "configs" / "train" / "debug.toml"
MOE_RECIPE = REPO / "configs" / "train" / "debug_moe.toml"
# Determinism for the runs compared bit for bit: torch's deterministic kernels (attention's
# backward, among others, otherwise adds partial sums in an order that varies from run to run)
# and a fixed cuBLAS workspace, which deterministic cuBLAS requires. Not warn_only: with it, SDPA's
# flash backward keeps its non-deterministic algorithm (torch only warns), which an H100 showed
# as a grad norm off in the 10th digit on the second step after the resume (2026-11-27). kiln
# reads no test switch: the test sets this from outside, in the process it starts.
DETERMINISTIC = (
    "import sys, torch; torch.use_deterministic_algorithms(True); "
    "from kiln.cli import main; sys.exit(main(sys.argv[1:]))"
)
RUN_TIMEOUT_S = 600


@dataclass(frozen=True)
class Size:
    """The model, batch, length and learning rate every run shares."""

    preset: str
    seq_len: int
    batch_size: int
    steps: int
    lr: float


# The 126M model at 3e-4: the demo recipe's 1e-3 is reached over 30 warm-up steps, and reached
# over these runs' 4 it made the loss spike at steps 6-10 on an H100 (2026-11-27: bf16 and fp32
# then differed by up to 6.9 nats, chaos rather than rounding). The debug recipe's lr for the
# debug model, whose loss starts at ln(its vocabulary) and would hardly move in 8 steps at less.
CUDA_SIZE = Size("llama3_125m", 1024, 8, 16, 3e-4)
CPU_SIZE = Size("debug", 128, 4, 8, 3e-3)


@dataclass(frozen=True)
class Run:
    """One finished `kiln train` run: its folder and the records of metrics.jsonl by step."""

    run_dir: Path
    records: dict[int, dict]
    overrides: list[str]
    output: str

    @property
    def losses(self) -> dict[int, float]:
        return {step: r["loss"] for step, r in self.records.items()}


def read_records(run_dir: Path) -> dict[int, dict]:
    """The step records of a run's metrics.jsonl, by step."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return {r["step"]: r for r in records if "loss" in r}


def subprocess_env() -> dict[str, str]:
    """This environment with the checkout first on the path and no bytecode written."""
    # A GPU machine may run the suite from a checkout that is not installed.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1"}


def run_command(command: list[str], log: Path, *, env: dict[str, str] | None = None) -> str:
    """Run `command` from the repository root, its output into `log`; on failure, fail the test."""
    result = subprocess.run(
        command,
        cwd=REPO,
        env={**subprocess_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    log.write_text(result.stdout)
    if result.returncode != 0:
        raise AssertionError(
            f"exit code {result.returncode}: {' '.join(command)}\n{result.stdout[-4000:]}"
        )
    return result.stdout


class TrainRuns:
    """Named runs of the same model, data and schedule in different settings (`settings`)."""

    def __init__(self, root: Path, data: Path, *, on_cuda: bool):
        self.root, self.data, self.on_cuda = root, data, on_cuda
        self.size = CUDA_SIZE if on_cuda else CPU_SIZE
        # The async checkpoint is taken at `save_step`, the run goes on to the end past it.
        self.save_step = self.size.steps * 5 // 8
        self._done: dict[str, Run] = {}

    def base_overrides(self) -> list[str]:
        """What every run shares: model, batch, schedule, data; no checkpoint; every step logged."""
        s = self.size
        return [
            f"--model.preset={s.preset}",
            f"--train.seq_len={s.seq_len}",
            f"--train.batch_size={s.batch_size}",
            f"--train.max_steps={s.steps}",
            f"--optimizer.lr={s.lr}",
            f"--train.device={'cuda' if self.on_cuda else 'cpu'}",
            "--scheduler.warmup_steps=4",
            f"--data.path={self.data}",
            "--checkpoint.interval=0",
            "--checkpoint.save_final=false",
            "--metrics.log_interval=1",
            "--metrics.plot=false",
        ]

    def settings(self, name: str) -> tuple[list[str], bool]:
        """(overrides, deterministic) of run `name`."""
        bf16, compiled = "--train.mixed_precision=bf16", "--train.compile=true"
        async_save = [
            f"--checkpoint.interval={self.save_step}",
            "--checkpoint.async_mode=async",
        ]
        table = {
            "fp32_eager": (["--train.mixed_precision=fp32"], False),
            # Bit for bit against its own resumed copy (test_async_resume.py).
            "bf16_eager": ([bf16, *async_save], True),
            "bf16_compiled": ([bf16, compiled], False),
            "bf16_compiled_full_ac": (
                [bf16, compiled, "--train.activation_checkpointing=full"],
                False,
            ),
            "bf16_compiled_chunked": (
                [bf16, compiled, "--train.loss=chunked_cross_entropy"],
                False,
            ),
        }
        return table[name]

    def get(self, name: str) -> Run:
        """Run `name`, started on first use."""
        if name not in self._done:
            overrides, deterministic = self.settings(name)
            self._done[name] = self._train(name, overrides, deterministic=deterministic)
        return self._done[name]

    def resumed(self, name: str) -> Run:
        """Run `name` again from a copy of its checkpoint folder: it resumes at `save_step`."""
        # The copy holds only the checkpoint of save_step: a crash after the save, a restart.
        key = f"{name}_resumed"
        if key not in self._done:
            source = self.get(name).run_dir / "checkpoints"
            run_dir = self.root / key
            shutil.copytree(source, run_dir / "checkpoints")
            overrides, deterministic = self.settings(name)
            self._done[key] = self._train(key, overrides, deterministic=deterministic)
        return self._done[key]

    def _train(self, name: str, overrides: list[str], *, deterministic: bool) -> Run:
        run_dir = self.root / name
        run_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "train",
            str(RECIPE),
            *self.base_overrides(),
            *overrides,
            f"--metrics.run_dir={run_dir}",
        ]
        head = ["-c", DETERMINISTIC] if deterministic else ["-m", "kiln"]
        # A fixed cuBLAS workspace: what deterministic cuBLAS needs (ignored on the CPU).
        env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if deterministic else {}
        output = run_command([sys.executable, *head, *args], self.root / f"{name}.log", env=env)
        return Run(run_dir, read_records(run_dir), [*self.base_overrides(), *overrides], output)


def make_trainer(
    recipe: Path, device: torch.device, run_dir: Path, data: Path, *overrides: str
) -> Trainer:
    """A kiln Trainer in this process, for the tests that look inside a step."""
    # The data read in this process; no checkpoint unless a test asks for one.
    from kiln.config import load_config
    from kiln.train.trainer import Trainer

    args = [
        f"--train.device={device.type}",
        f"--data.path={data}",
        f"--metrics.run_dir={run_dir}",
        "--data.num_workers=0",
        "--checkpoint.interval=0",
        "--checkpoint.save_final=false",
        "--metrics.plot=false",
        *overrides,
    ]
    return Trainer(load_config(recipe, args, world_size=1))
