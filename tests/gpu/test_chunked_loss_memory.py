"""The chunked cross-entropy (kiln/train/loss.py) peaks below the plain loss in GPU memory
(`torch.cuda.max_memory_allocated`): one step of a large-vocabulary model in this process, and
the `kiln train` runs the memory-estimate tests share. benchmarks/chunked_loss.md measured the
same on the CPU (peak RSS and the profiler's live tensors)."""

from __future__ import annotations

import pytest
import torch

from kiln.config import ModelConfig, load_config, resolve_layout
from kiln.model import build_model, materialize
from kiln.plan.activations import logit_bytes
from kiln.train.loss import chunked_token_loss_sum, token_loss_sum
from tests.gpu.runs import RECIPE, TrainRuns

NO_CPU_PEAK = "torch.cuda.max_memory_allocated (and peak_mem_gb) exist on CUDA only"
# Llama 3's vocabulary, where the logits dominate a small model's step (benchmarks/chunked_loss.py).
MODEL = ModelConfig(
    dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=768, vocab_size=128256,
    max_seq_len=2048,
)  # fmt: skip
BATCH, SEQ, CHUNK = 2, 2048, 1024
# The plain loss holds several (tokens × vocab) tensors at its peak: the bf16 logits, their fp32
# copy, the log-softmax and in backward its gradient and the logits' (about 14 bytes a logit,
# 7 GB here); the chunked loss holds the same for one chunk, a quarter of the tokens, plus what
# both hold (the head's gradient, the blocks' activations). Half is a loose bound on the ratio.
RATIO = 0.5


def step_peak(model: torch.nn.Module, tokens: torch.Tensor, *, chunked: bool) -> tuple:
    """(peak bytes the step adds, loss) of one forward and backward in bf16 autocast."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        output = model(inputs, apply_head=not chunked)
        if chunked:
            loss = chunked_token_loss_sum(output, model.head_weight(), labels, chunk_tokens=CHUNK)
        else:
            loss = token_loss_sum(output, labels)
    (loss / labels.numel()).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, loss.item()


@pytest.mark.cuda_only(NO_CPU_PEAK)
@pytest.mark.needs_bf16
def test_chunked_loss_peaks_below_the_plain_loss(device: torch.device) -> None:
    model = materialize(build_model(MODEL), device=device, seed=0)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(MODEL.vocab_size, (BATCH, SEQ + 1), generator=generator).to(device)
    for chunked in (False, True):  # warm-up: cuBLAS workspaces and the like, once
        step_peak(model, tokens, chunked=chunked)
    plain, plain_loss = step_peak(model, tokens, chunked=False)
    chunked, chunked_loss = step_peak(model, tokens, chunked=True)
    assert chunked <= RATIO * plain, (chunked / 1e9, plain / 1e9)
    # The same loss: both round the head's bf16 logits alike; the sums differ in order only,
    # far below one bf16 step of the total.
    assert chunked_loss == pytest.approx(plain_loss, rel=2**-8)


@pytest.mark.cuda_only(NO_CPU_PEAK)
@pytest.mark.needs_bf16
def test_kiln_train_with_the_chunked_loss_peaks_lower(train_runs: TrainRuns) -> None:
    """The memory-estimate tests' compiled bf16 runs, plain and chunked, peak apart."""
    # The same model, batch and settings but the loss; the logits are most of the peak.
    peaks, logits = {}, {}
    for name in ("bf16_compiled", "bf16_compiled_chunked"):
        run = train_runs.get(name)
        peaks[name] = max(r["peak_mem_gb"] for r in run.records.values())
        cfg = load_config(RECIPE, run.overrides, world_size=1)
        logits[name] = logit_bytes(cfg, resolve_layout(cfg.distributed, 1)) / 1e9
    saved = peaks["bf16_compiled"] - peaks["bf16_compiled_chunked"]
    expected = logits["bf16_compiled"] - logits["bf16_compiled_chunked"]
    # kiln check's logits term counts 12 of the ~14 bytes a logit the loss holds at its peak
    # (kiln/plan/activations.py); at least half of its saving must show in the measured peaks.
    assert saved >= 0.5 * expected, (peaks, logits)
