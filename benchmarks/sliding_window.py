"""Sliding-window attention and attention sinks against full causal attention: time and peak
memory of one kiln attention layer, forward and backward, over sequence lengths.

One `kiln.model.llama.attention.Attention` (dim 512, 8 heads of 64, 4 KV heads; fp32 on CPU,
bf16 on CUDA; batch 1) per case, each case and length in its own subprocess:

- full causal: no mask, SDPA `is_causal` (what runs without a window or sinks);
- full + sinks: the causal mask by shape (`causal_mask`) and the sinks;
- window W, window W + sinks: `Attention(cfg, window=W)`, the mask by shape.

On CPU the masks are dense boolean (seq × seq) masks under SDPA, and with sinks the softmax is
written out with one more column; on CUDA they are flex attention block masks (compiled).

Each subprocess builds the layer and its input, reads its peak resident memory (`ru_maxrss`) as
the baseline, runs `--warmup` forward+backward steps and `--repeats` timed ones, then reports
the median wall and CPU time per step and the peak memory grown over the baseline (torch's CPU
allocations are not tracked by tracemalloc; on CUDA the allocator's peak over what is
allocated at the baseline). A case is skipped at a length where its time per step, or its
memory, predicted from the length before (both quadratic in the length for a masked case),
would pass `--max-step-s` or 80% of the memory available.

    python benchmarks/sliding_window.py [--seq 1024 2048 4096 8192 16384] [--windows 128 1024]
        [--device cpu|cuda] [--warmup 1] [--repeats 3] [--max-step-s 30]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kiln.config import ModelConfig
from kiln.model.counts import causal_attention_flops
from kiln.model.init import init_decoder_weights
from kiln.model.llama.attention import Attention
from kiln.model.rope import rope_tables

CFG = {"dim": 512, "n_heads": 8, "n_kv_heads": 4, "head_dim": 64}


def case_names(windows: list[int]) -> list[tuple[str, int, bool]]:
    """(name, window, sinks) of every case, full causal attention first (the ratios' base)."""
    cases = [("full causal", 0, False), ("full + sinks", 0, True)]
    for w in windows:
        cases += [(f"window {w}", w, False), (f"window {w} + sinks", w, True)]
    return cases


def run_case(seq: int, window: int, sinks: bool, args: argparse.Namespace) -> dict[str, float]:
    """One case in this process: median step times and peak memory growth."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = ModelConfig(**CFG, max_seq_len=seq, attention_sinks=sinks)
    layer = Attention(cfg, window=window)
    init_decoder_weights(layer, cfg, seed=0)
    layer.to(device=device, dtype=dtype)
    cos, sin = rope_tables(cfg.resolved_head_dim, seq, cfg.rope_theta, device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq, cfg.dim, generator=gen).to(device=device, dtype=dtype)
    x.requires_grad_()  # as inside a model: the layer's input needs its gradient too
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def step() -> None:
        layer(x, cos, sin).sum().backward()
        x.grad = None
        layer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    wall, cpu = [], []
    for _ in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {
        "step_s": statistics.median(wall),
        "cpu_s": statistics.median(cpu),
        "peak_mib": peak / 2**20,
        "base_mib": base / 2**20,
    }


def available_mib() -> float:
    """Memory the kernel can still hand out (MemAvailable), in MiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def skip_reason(prev: dict | None, seq: int, args: argparse.Namespace) -> str:
    """Why a case should not run at length `seq`, given `prev`, its result at the length
    before ('': run it)."""
    if prev is None or "skipped" in prev:
        return "" if prev is None else "skipped at the length before"
    # Cost grows with the square of the length: the masked kernels compute every score.
    growth = (seq / prev["seq"]) ** 2
    reasons = []
    step_s = growth * prev["step_s"]
    if step_s > args.max_step_s:
        reasons.append(f"predicted {step_s:.1f} s a step > {args.max_step_s:g} s")
    peak_gib, free_gib = growth * prev["peak_mib"] / 1024, available_mib() / 1024
    if args.device == "cpu" and peak_gib > 0.8 * free_gib:
        reasons.append(f"predicted peak {peak_gib:.1f} GiB > 80% of {free_gib:.1f} GiB available")
    return "; ".join(reasons)


def flops_gflop(seq: int, window: int) -> float:
    """kiln's forward + backward attention FLOPs of the layer over the sequence, in GFLOP."""
    hd = CFG["head_dim"]
    return seq * causal_attention_flops(seq, CFG["n_heads"], hd, hd, window=window) / 1e9


def row(seq: int, name: str, r: dict, full: dict | None, gflop: float, full_gflop: float) -> str:
    """One line of the table: the case's figures and their ratios to full causal attention."""

    def ratio(key: str) -> str:
        return f"{r[key] / full[key]:.2f}" if full else "-"

    return (
        f"| {seq} | {name} | {r['step_s']:.3f} | {ratio('step_s')} | {r['cpu_s']:.2f} "
        f"| {r['peak_mib']:.0f} | {ratio('peak_mib')} | {gflop:.2f} | {gflop / full_gflop:.3f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-step-s", type=float, default=30.0)
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)  # seq window sinks: a child
    args = parser.parse_args()
    if args.case:
        seq, window, sinks = int(args.case[0]), int(args.case[1]), args.case[2] == "1"
        print(json.dumps(run_case(seq, window, sinks, args)))
        return

    sys.stdout.reconfigure(line_buffering=True)  # rows appear as the cases finish
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| seq | case | step s | vs full | CPU s | peak MiB | vs full | kiln GFLOP | vs full |")
    print("|---|---|---|---|---|---|---|---|---|")
    prev: dict[str, dict] = {}
    for seq in args.seq:
        full: dict | None = None
        for name, window, sinks in case_names(args.windows):
            reason = skip_reason(prev.get(name), seq, args)
            gflop = flops_gflop(seq, window)
            if reason:
                prev[name] = {"skipped": reason}
                ratio = gflop / flops_gflop(seq, 0)
                print(f"| {seq} | {name} | skipped: {reason} | | | | | {gflop:.2f} | {ratio:.3f} |")
                continue
            cmd = [sys.executable, __file__, "--device", args.device, "--warmup"]
            cmd += [str(args.warmup), "--repeats", str(args.repeats)]
            cmd += ["--case", str(seq), str(window), "1" if sinks else "0"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                prev[name] = {"skipped": f"failed at {seq} (exit {done.returncode})"}
                tail = done.stderr.strip().splitlines()[-1:] or ["no stderr"]
                print(f"| {seq} | {name} | failed: exit {done.returncode}, {tail[0]} |")
                continue
            r = prev[name] = json.loads(done.stdout.strip().splitlines()[-1]) | {"seq": seq}
            full = r if name == "full causal" else full
            print(row(seq, name, r, full, gflop, flops_gflop(seq, 0)))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
