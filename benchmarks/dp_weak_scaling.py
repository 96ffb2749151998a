"""Weak scaling of data-parallel training on CPU (gloo): the same per-rank batch on 1, 2, 4 ranks.

A sanity figure for the FSDP path, not a performance claim: on a 2-core machine, 4 ranks
oversubscribe the cores. Each run trains the debug recipe for --steps steps with one thread
per rank; the step time is the median over the steps after the first log window.

    python benchmarks/dp_weak_scaling.py --ranks 1 2 4 --steps 40
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from launch import train_records


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--data", default="data/demo")
    args = parser.parse_args()

    print("| ranks | global batch (seq) | median step (ms) | tok/s (all ranks) | tok/s per rank |")
    print("|---|---|---|---|---|")
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            records = train_records(
                ranks,
                f"--train.batch_size={args.batch_size}",
                "--metrics.log_interval=5",
                run_dir=Path(tmp) / "run",
                steps=args.steps,
                data=args.data,
            )
        steady = [r for r in records if r["step"] > 5]  # the first window includes start-up
        tok_s = statistics.median(r["tokens_per_sec"] for r in steady)
        tokens_per_step = args.batch_size * ranks * 128
        print(
            f"| {ranks} | {args.batch_size * ranks} | {1e3 * tokens_per_step / tok_s:.1f} | {tok_s:,.0f} | {tok_s / ranks:,.0f} |"
        )


if __name__ == "__main__":
    main()
