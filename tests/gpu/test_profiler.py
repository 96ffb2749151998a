"""The profiler on CUDA ([profiling], kiln/metrics/profiler.py): a Chrome trace of the chosen
steps with the GPU's kernels and kiln's phases in it, and with `record_memory` the CUDA
allocator's memory snapshot (for pytorch.org/memory_viz), as benchmarks/gpu_runs.md saw them."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from tests.gpu.runs import DEBUG_RECIPE, make_trainer

START, END = 2, 3
PHASES = {"data", "forward", "backward", "optimizer"}


@pytest.fixture(scope="module")
def profile_dir(
    device: torch.device, demo_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A short run tracing steps START..END with the memory history on; its rank 0 folder."""
    run_dir = tmp_path_factory.mktemp("profiled")
    trainer = make_trainer(
        DEBUG_RECIPE,
        device,
        run_dir,
        demo_data,
        f"--train.max_steps={END + 1}",
        "--scheduler.warmup_steps=1",
        "--profiling.enabled=true",
        f"--profiling.start_step={START}",
        f"--profiling.end_step={END}",
        "--profiling.record_memory=true",
    )
    trainer.train()
    return run_dir / "profile" / "rank_0"


def test_trace_has_the_kernels_and_kiln_phases(profile_dir: Path, device: torch.device) -> None:
    trace = json.loads((profile_dir / f"steps_{START}-{END}.pt.trace.json").read_text())
    events = trace["traceEvents"]
    names = {e.get("name") for e in events}
    assert names >= PHASES, PHASES - names
    if device.type == "cuda":  # the dry run's CPU has no kernels to trace
        kernels = [e for e in events if e.get("cat") == "kernel"]
        assert kernels, "no CUDA kernel in the trace"


@pytest.mark.cuda_only("the memory snapshot is the CUDA allocator's history")
def test_memory_snapshot_is_written(profile_dir: Path) -> None:
    with open(profile_dir / "memory_snapshot.pickle", "rb") as file:
        snapshot = pickle.load(file)
    assert snapshot["segments"], "no allocator segment in the snapshot"
    actions = {entry["action"] for trace in snapshot["device_traces"] for entry in trace}
    assert {"alloc", "free_completed"} <= actions, actions
