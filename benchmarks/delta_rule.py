"""Cost of the gated delta rule's torch kernels against softmax attention of the same width.

One layer's core on random inputs, batch 1, `heads` heads of width `dim` (key and value): kiln's
chunked kernel (`chunk_gated_delta_rule`, chunk 64: what runs on CPU and without fla-core), the
step-by-step reference (`recurrent_gated_delta_rule`) and causal SDPA on (q, k, v) of the same
shape. Each is timed forward (with autograd recording, as in training) and forward+backward
(gradients of every input), round-robin so that drifting load hits all alike, keeping each one's
fastest run: on a shared machine the others' load only ever adds time. Then each runs once
more under torch.profiler with profile_memory, and the peak of the running sum of its allocations
and frees is reported: the most memory the call held above what was live before it. The
recurrent reference keeps every step's state for backward (seq·heads·dim² floats, 4 GiB at 8k
tokens and width 128) and backward runs its thousands of small steps one by one, so it runs up
to --recurrent-max-seq only: its cost is linear in seq, the ratio to the chunked one steady.

    OMP_NUM_THREADS=1 python benchmarks/delta_rule.py [--seq 512 1024 ...] [--dims 64 128]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from kiln.model.qwen3_next.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

VARIANTS = ("chunked", "recurrent", "SDPA")


def make_calls(seq: int, dim: int, heads: int) -> dict[str, tuple[Callable, list[torch.Tensor]]]:
    """Each variant: a function computing its output, and the leaves it takes gradients of."""
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(1, seq, heads, dim, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, seq, heads, dim, generator=gen)
    g = F.logsigmoid(torch.randn(1, seq, heads, generator=gen) + 3)
    beta = torch.sigmoid(torch.randn(1, seq, heads, generator=gen))
    delta = [x.requires_grad_() for x in (q, k, v, g, beta)]
    attention = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
    scale = dim**-0.5
    return {
        "chunked": (lambda: chunk_gated_delta_rule(*delta, scale=scale)[0], delta),
        "recurrent": (lambda: recurrent_gated_delta_rule(*delta, scale=scale)[0], delta),
        "SDPA": (lambda: F.scaled_dot_product_attention(*attention, is_causal=True), attention),
    }


def with_backward(fn: Callable, leaves: list[torch.Tensor]) -> Callable:
    def step() -> None:
        out = fn()
        torch.autograd.grad(out.sum(), leaves)

    return step


def interleaved_fastest(fns: dict[str, Callable], warmup: int, repeats: int) -> dict[str, float]:
    """The fastest of `repeats` runs of each function, in ms, timed round-robin."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(1000 * (time.perf_counter() - start))
    return {name: min(t) for name, t in times.items()}


def peak_mib(fn: Callable) -> float:
    """The highest running total of the CPU allocations `fn` makes, in MiB."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    total = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        total += event.nbytes()
        peak = max(peak, total)
    return peak / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--recurrent-max-seq", type=int, default=1024)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, batch 1")
    print(f"heads {args.heads}; times: fastest of {args.repeats} runs, ms; memory: peak MiB\n")
    print(
        "| seq | dim | pass | chunked ms | recurrent ms | SDPA ms | recurrent/chunked "
        "| chunked/SDPA | chunked MiB | recurrent MiB | SDPA MiB |"
    )
    print("|" + "---|" * 11)
    for dim in args.dims:
        for seq in args.seq:
            calls = make_calls(seq, dim, args.heads)
            if seq > args.recurrent_max_seq:
                del calls["recurrent"]
            for label, wrap in (("fwd", None), ("fwd+bwd", with_backward)):
                fns = {n: wrap(fn, leaves) if wrap else fn for n, (fn, leaves) in calls.items()}
                ms = interleaved_fastest(fns, args.warmup, args.repeats)
                mib = {name: peak_mib(fn) for name, fn in fns.items()}
                times = " | ".join(f"{ms[n]:.1f}" if n in ms else "-" for n in VARIANTS)
                peaks = " | ".join(f"{mib[n]:.1f}" if n in mib else "-" for n in VARIANTS)
                slower = f"{ms['recurrent'] / ms['chunked']:.1f}" if "recurrent" in ms else "-"
                ratios = f"{slower} | {ms['chunked'] / ms['SDPA']:.2f}"
                print(f"| {seq} | {dim} | {label} | {times} | {ratios} | {peaks} |", flush=True)


if __name__ == "__main__":
    main()
