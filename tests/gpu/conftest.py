"""The GPU suite (`make test-gpu`): every test here is marked `gpu` and skips, with its reason,
where it cannot run: without a CUDA device, on a GPU without bf16 or float8, and in the dry run.

Dry run: KILN_TEST_GPU_ON_CPU=1 runs the suite on the CPU instead, to check the test code on a
machine without a GPU: kernels that exist on the CPU run there, `kiln train` runs take
train.device=cpu and the small debug model, and what needs CUDA itself skips, saying why. This
file is the only place that reads the switch; kiln reads no test switch.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from tests.gpu.runs import TrainRuns

GPU_DIR = Path(__file__).resolve().parent
DRY_RUN_ENV = "KILN_TEST_GPU_ON_CPU"
# bf16 tensor cores (and torch.cuda.is_bf16_supported) start with Ampere.
BF16_CAPABILITY = (8, 0)


def dry_run() -> bool:
    """Whether this session is the dry run on the CPU."""
    return os.environ.get(DRY_RUN_ENV) == "1"


@functools.cache
def cuda_available() -> bool:
    """torch.cuda.is_available(), asked once."""
    return torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    """Register this folder's markers."""
    config.addinivalue_line(
        "markers", "cuda_only(reason): needs CUDA itself; skipped in the dry run with the reason"
    )
    config.addinivalue_line("markers", "needs_bf16: needs a GPU with bf16 (compute capability 8.0)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark this folder's tests `gpu` and skip those that cannot run here, saying why."""
    # Only a flag and torch.cuda.is_available() are read: collected by `make test`, the tests
    # skip in milliseconds, and no fixture (data, runs) is ever set up for a skipped test.
    for item in items:
        if GPU_DIR not in item.path.parents:
            continue  # this hook sees the whole session's items
        item.add_marker(pytest.mark.gpu)
        reason = skip_reason(item)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def skip_reason(item: pytest.Item) -> str | None:
    """Why `item` cannot run in this session, or None."""
    cuda_only = item.get_closest_marker("cuda_only")
    if dry_run():
        if cuda_only is not None:
            return f"dry run on the CPU ({DRY_RUN_ENV}=1): {cuda_only.args[0]}"
        return None
    if not cuda_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if item.get_closest_marker("needs_bf16") is not None:
        return bf16_problem()
    return None


def bf16_problem() -> str | None:
    """Why this GPU cannot run bf16, naming its compute capability, or None."""
    have = torch.cuda.get_device_capability()
    if have < BF16_CAPABILITY:
        need = ".".join(map(str, BF16_CAPABILITY))
        return (
            f"bf16 needs compute capability >= {need}; {torch.cuda.get_device_name()} has "
            f"{have[0]}.{have[1]}"
        )
    return None


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the suite tests: the GPU, or the CPU in the dry run."""
    return torch.device("cpu" if dry_run() else "cuda")


@pytest.fixture(scope="session")
def train_runs(demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainRuns:
    """The `kiln train` runs the tests share, each started on first use and kept for the session."""
    return TrainRuns(tmp_path_factory.mktemp("runs"), demo_data, on_cuda=not dry_run())
