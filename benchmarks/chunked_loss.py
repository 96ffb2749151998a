"""Peak memory and step time of the chunked cross-entropy against the plain loss at a large vocabulary.

A small kiln Transformer with Llama 3's vocabulary (dim 256, 2 layers, vocab 128256, untied
head) on a batch of 2 × 1024 tokens: one forward and backward (no optimizer step) with
`train.loss = "cross_entropy"` (the model returns the logits of all 2048 tokens) and with
`"chunked_cross_entropy"` at several `train.loss_chunk_tokens` (the model returns the final
norm's output, the loss applies the head chunk by chunk and recomputes each chunk's logits in
its backward). Each variant's memory is measured in fresh processes:

- peak RSS: the process's high-water resident set (`ru_maxrss`) minus its resident set just
  before the step, everything (model, inputs) already built: what the step adds at its peak;
- peak tensors: the largest total of live tensor bytes during the step, from torch's memory
  profiler (allocator events), the step's own allocations.

Step time: the median of forward+backward, the variants timed round-robin in one process so
that drifting load hits all alike.

    python benchmarks/chunked_loss.py [--chunks 2048 1024 512 256] [--repeats 5]
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
from collections.abc import Callable

import torch

from kiln.config import ModelConfig
from kiln.model import build_model, materialize
from kiln.train.loss import chunked_token_loss_sum, token_loss_sum

PLAIN = "cross_entropy"


def make_model(args: argparse.Namespace):
    cfg = ModelConfig(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden_dim=3 * args.dim,
        vocab_size=args.vocab,
        max_seq_len=args.seq,
    )
    model = materialize(build_model(cfg), device="cpu", seed=0)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=generator)
    return model, tokens[:, :-1], tokens[:, 1:]


def step_fn(variant: str, model, inputs, labels, precision: str) -> Callable[[], None]:
    """One forward and backward of `variant` (PLAIN or a chunk size), normalized by the tokens
    as the trainer does; parameter gradients are dropped after each."""
    chunk = None if variant == PLAIN else int(variant)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    def step() -> None:
        with autocast:
            output = model(inputs, apply_head=chunk is None)
            if chunk is None:
                loss = token_loss_sum(output, labels)
            else:
                loss = chunked_token_loss_sum(
                    output, model.head_weight(), labels, chunk_tokens=chunk
                )
        (loss / labels.numel()).backward()
        model.zero_grad(set_to_none=True)

    return step


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_memory(args: argparse.Namespace) -> dict[str, float]:
    """In this (fresh) process: one step of args.variant, its peak RSS or peak tensor bytes."""
    model, inputs, labels = make_model(args)
    step = step_fn(args.variant, model, inputs, labels, args.precision)
    if args.what == "rss":
        before = rss_bytes()
        step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {"rss": peak - before}
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    totals = [sum(s) for s in sizes]
    return {"tensors": max(totals) - totals[0]}


def in_fresh_process(args: argparse.Namespace, variant: str, what: str) -> float:
    command = [sys.executable, __file__, "--variant", variant, "--what", what]
    command += ["--chunks", *map(str, args.chunks), *shape_args(args)]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])[what]


def shape_args(args: argparse.Namespace) -> list[str]:
    names = ("dim", "layers", "vocab", "seq", "batch", "precision")
    return [f"--{name}={getattr(args, name)}" for name in names]


def interleaved_medians(fns: dict[str, Callable[[], None]], warmup: int, repeats: int):
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 1024, 512, 256])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: one memory measurement
    parser.add_argument("--what", choices=("rss", "tensors"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is not None:
        print(json.dumps(measure_memory(args)))
        return

    tokens = args.batch * args.seq
    variants = [PLAIN, *map(str, args.chunks)]
    print(
        f"dim {args.dim}, {args.layers} layers, vocab {args.vocab}, {args.batch} x {args.seq} "
        f"tokens, {args.precision}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"full fp32 logits: {tokens * args.vocab * 4 / 2**20:.0f} MiB",
        flush=True,
    )
    memory = {
        v: {what: in_fresh_process(args, v, what) for what in ("rss", "tensors")} for v in variants
    }
    model, inputs, labels = make_model(args)
    fns = {v: step_fn(v, model, inputs, labels, args.precision) for v in variants}
    seconds = interleaved_medians(fns, args.warmup, args.repeats)
    base_mem, base_time = memory[PLAIN], seconds[PLAIN]
    print(
        "| loss | chunk tokens | peak RSS (MiB) | ratio | peak tensors (MiB) | ratio | step (s) | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        name, chunk = ("cross_entropy", "-") if v == PLAIN else ("chunked_cross_entropy", v)
        rss, tensors = memory[v]["rss"], memory[v]["tensors"]
        print(
            f"| {name} | {chunk} | {rss / 2**20:.0f} | {rss / base_mem['rss']:.2f} "
            f"| {tensors / 2**20:.0f} | {tensors / base_mem['tensors']:.2f} "
            f"| {seconds[v]:.2f} | {seconds[v] / base_time:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
