"""MFU and peak memory in metrics.jsonl on CUDA (kiln/metrics/step_records.py, mfu.py): present,
consistent with a FLOP count made here independently of kiln's, and plausible for the GPU.
On the CPU both are null (tests/unit/test_trainer.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.config import load_config
from kiln.events import read_events
from kiln.metrics.mfu import peak_flops
from kiln.model import build_model
from tests.gpu.runs import RECIPE, TrainRuns

# Bounds on the MFU of a 126M model at 8 x 1024 tokens, after the first step (which compiles
# and warms up): below 2% an H100 would be idle most of the step (a host sync per kernel, a
# kernel running on the CPU); no training step reaches three quarters of the dense bf16 peak.
MFU_RANGE = (0.02, 0.75)
# fp32 master weights, their gradients and AdamW's two moments: 16 bytes a parameter, all
# resident at the peak (the gradients are built by the backward that precedes the step).
MODEL_STATE_BYTES = 16


def honest_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token, counted on the model's weights, not by kiln's formula."""
    # 6 per matmul weight a token meets (every 2-D weight but the embedding's lookup table),
    # plus causal attention: 6 · layers · seq · dim per token (half of 12 · L · S · D).
    cfg = model.cfg
    matmul = sum(
        p.numel() for name, p in model.named_parameters() if p.ndim == 2 and "tok_embed" not in name
    )
    return 6 * matmul + 6 * cfg.n_layers * seq_len * cfg.n_heads * cfg.resolved_head_dim


def steps_beside_a_save(run_dir: Path) -> set[int]:
    """The steps that ran while an async checkpoint was written in the background."""
    # Their MFU is honest but not the model's: on an H100 the step after an async save of the
    # 126M model ran at 1.1% (2026-11-27), the writer thread sharing the host with the loop.
    saves = [e for e in read_events(run_dir) if e["event"] == "checkpoint"]
    return {
        step
        for e in saves
        for step in range(e["step"] + 1, (e.get("committed_after_step") or e["step"]) + 1)
    }


@pytest.mark.cuda_only("kiln logs mfu and peak_mem_gb as null on the CPU")
@pytest.mark.needs_bf16
@pytest.mark.parametrize("name", ["bf16_eager", "bf16_compiled"])
def test_mfu_and_peak_memory_are_present_and_plausible(
    name: str, train_runs: TrainRuns, device: torch.device
) -> None:
    run = train_runs.get(name)
    cfg = load_config(RECIPE, run.overrides, world_size=1)
    model = build_model(cfg.model)  # on the meta device: shapes only
    params = sum(p.numel() for p in model.parameters())
    peak = peak_flops(device)
    if peak is None:
        pytest.skip(f"{torch.cuda.get_device_name(device)} is not in kiln's peak FLOPs table")
    flops = honest_flops_per_token(model, cfg.train.seq_len)
    total_memory = torch.cuda.get_device_properties(device).total_memory
    records = [run.records[step] for step in sorted(run.records)]
    writing = steps_beside_a_save(run.run_dir)
    for record in records[1:]:
        mfu = record["mfu"]
        if record["step"] not in writing:
            assert MFU_RANGE[0] < mfu < MFU_RANGE[1], record
        # Same definition, counted here: only float rounding apart.
        expected = flops * record["tokens_per_sec"] / peak
        assert mfu == pytest.approx(expected, rel=1e-6), record
    peaks = [record["peak_mem_gb"] for record in records]
    assert peaks == sorted(peaks), peaks  # the process's high-water mark never falls
    assert MODEL_STATE_BYTES * params / 1e9 < peaks[-1] < total_memory / 1e9, peaks
