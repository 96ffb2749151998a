"""Step time of each pipeline schedule at pp=2 and pp=4 on CPU (gloo): a sanity table.

The debug model with 8 layers, a global batch of 8 sequences of 128 tokens split into 8
micro-batches, one thread per rank, fp32. Step time is the median over the steps after the first
two (the first pass also infers the stage shapes). On a 2-core machine pp=4 oversubscribes the
cores, and with a 1.4M-parameter model gloo's point-to-point latency dominates: the table shows
that every schedule runs and what it costs here, not what it does on GPUs.

    python benchmarks/pipeline_schedules.py --pp 2 4 --steps 12
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from launch import train_records

SCHEDULES = {  # schedule: stages per rank
    "gpipe": 1,
    "1f1b": 1,
    "interleaved_1f1b": 2,
    "interleaved_zero_bubble": 2,
    "zbv": 2,
}
MODEL = ("--model.n_layers=8", "--train.batch_size=8", "--metrics.log_interval=1")


def median_step_ms(records: list[dict], tokens_per_step: int) -> float:
    steady = [r for r in records if r["step"] > 2]
    return 1e3 * statistics.median(tokens_per_step / r["tokens_per_sec"] for r in steady)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--data", default="data/demo")
    args = parser.parse_args()
    tokens = 8 * 128

    def measure(ranks: int, *overrides: str) -> float:
        with tempfile.TemporaryDirectory() as tmp:
            records = train_records(
                ranks,
                *MODEL,
                *overrides,
                run_dir=Path(tmp) / "run",
                steps=args.steps,
                data=args.data,
            )
        return median_step_ms(records, tokens)

    print("| layout | schedule | stages | median step (ms) | vs one process |")
    print("|---|---|---|---|---|")
    one = measure(1)
    print(f"| one process | - | 1 | {one:.0f} | 1.00x |")
    for pp in args.pp:
        for schedule, virtual in SCHEDULES.items():
            ms = measure(
                pp,
                f"--distributed.pp={pp}",
                f"--distributed.pp_schedule={schedule}",
                f"--distributed.pp_virtual_stages={virtual}",
            )
            print(f"| pp={pp} | {schedule} | {pp * virtual} | {ms:.0f} | {ms / one:.2f}x |")


if __name__ == "__main__":
    main()
