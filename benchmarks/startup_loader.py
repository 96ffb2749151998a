"""Loader start-up over a huge dataset: the per-index shuffle against a materialized permutation.

For each dataset size, a fresh process builds a `BatchLoader` over a fake dataset of that many
samples (`__len__` and `sample` only: no data on disk, so only the order costs anything) and
times the construction, the first `next_step()` (where the old shuffle built its permutation)
and the mean of the next steps. Peak memory is measured twice, in separate processes so neither
disturbs the other's timing: the growth of the peak resident set over the process after imports,
and the peak that tracemalloc sees (numpy reports its arrays to it).

"before" is the shuffle kiln used until `feistel-v1`, reimplemented here: the dataset index of
sample k is `np.random.default_rng([seed, epoch]).permutation(n)[k % n]`, the permutation cached
per epoch. It is measured only up to --max-old samples: at 2e9 it needs 16 GB (8 bytes a sample),
which does not fit safely beside other jobs on a 24 GiB machine. Usage:

    python benchmarks/startup_loader.py [--sizes 1e6 1e8 2e9] [--max-old 1e8]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import tracemalloc
from functools import lru_cache

import numpy as np

from kiln.config.sections import DataConfig
from kiln.data.loader import BatchLoader, ShuffledSamples, Source

SEED = 1


class FakeDataset:
    """n samples of seq_len + 1 tokens with nothing behind them."""

    eos_id = 0

    def __init__(self, n: int, seq_len: int):
        self.n, self.tokens = n, np.zeros(seq_len + 1, dtype=np.int64)

    def __len__(self) -> int:
        return self.n

    def sample(self, i: int) -> np.ndarray:
        return self.tokens


class OldShuffledSamples:
    """The shuffle before `feistel-v1`: a materialized permutation per epoch, read per row."""

    streaming, shuffle = False, True

    def __init__(self, dataset: FakeDataset, *, seed: int):
        self.dataset, self.seed = dataset, seed

    def read(self, ks: list[int]) -> list[np.ndarray]:
        return [self.sample(k) for k in ks]

    def sample(self, k: int) -> np.ndarray:
        n = len(self.dataset)
        epoch, offset = divmod(k, n)
        return self.dataset.sample(int(_permutation(self.seed, epoch, n)[offset]))


@lru_cache(maxsize=8)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def measure(method: str, n: int, trace: bool, args: argparse.Namespace) -> dict[str, float]:
    """One loader's start-up, in this process (run by `main` in a fresh one per measurement)."""
    rss_before = _rss_bytes()
    if trace:
        tracemalloc.start()
    start = time.perf_counter()
    samples_cls = ShuffledSamples if method == "after" else OldShuffledSamples
    source = Source("data", samples_cls(FakeDataset(n, args.seq_len), seed=SEED), 0)
    loader = BatchLoader(
        [source], DataConfig(), seed=SEED, batch_size=args.batch, grad_accum_steps=1
    )
    built = time.perf_counter()
    loader.next_step()
    first = time.perf_counter()
    for _ in range(args.steps):
        loader.next_step()
    later = time.perf_counter()
    out = {
        "construct_s": built - start,
        "first_step_s": first - built,
        "later_step_ms": (later - first) / args.steps * 1e3,
        "peak_rss_growth_mb": (_peak_rss_bytes() - rss_before) / 1e6,
    }
    if trace:
        out["tracemalloc_peak_mb"] = tracemalloc.get_traced_memory()[1] / 1e6
        tracemalloc.stop()
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_child(method: str, n: int, trace: bool, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", method, str(n), str(int(trace))]
    command += ["--seq-len", str(args.seq_len), "--batch", str(args.batch)]
    command += ["--steps", str(args.steps)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e8, 2e9])
    parser.add_argument("--max-old", type=float, default=1e8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        method, n, trace = args.child
        print(json.dumps(measure(method, int(n), trace == "1", args)))
        return
    print(
        "| shuffle | samples | construct | first step | later steps | peak RSS growth "
        "| tracemalloc peak |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in (int(size) for size in args.sizes):
        for method in ("before", "after"):
            if method == "before" and n > args.max_old:
                size = n * 8 / 1e9
                print(
                    f"| {method} | {n:.0e} | not run | not run | not run "
                    f"| >= {size:.0f} GB (computed: int64 permutation) | - |"
                )
                continue
            timed = run_child(method, n, False, args)
            traced = run_child(method, n, True, args)
            print(
                f"| {method} | {n:.0e} | {timed['construct_s'] * 1e3:.2f} ms "
                f"| {timed['first_step_s'] * 1e3:.1f} ms | {timed['later_step_ms']:.3f} ms "
                f"| {timed['peak_rss_growth_mb']:.1f} MB | {traced['tracemalloc_peak_mb']:.2f} MB |",
                flush=True,
            )


if __name__ == "__main__":
    main()
