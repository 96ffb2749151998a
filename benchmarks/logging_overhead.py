"""What the logging backends and the profiler cost per step, measured side by side on CPU.

Each variant trains the same recipe for --steps steps with every step logged (log_interval = 1,
the harshest setting: a real run logs every 10 or more). A record's `tokens_per_sec` covers the
time since the previous record, which includes writing the previous record to every backend, so
the mean over the records after the first two (start-up, warm-up) is the steady-state
throughput with that variant's logging in it. Variants alternate, --repeats times, so drift in
machine load hits them alike. The profiler's cost is read off the same way: the traced steps'
throughput against the untraced steps of the same run.

    python benchmarks/logging_overhead.py --config configs/train/demo.toml --steps 24 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from kiln.config import load_config
from kiln.metrics.logger import read_metrics
from kiln.train.trainer import Trainer

VARIANTS = {
    "JSONL only": [],
    "JSONL + TensorBoard + W&B (offline)": [
        "--metrics.tensorboard=true",
        "--metrics.wandb=true",
        "--metrics.wandb_mode=offline",
    ],
}
PROFILED = (8, 11)


def run(
    config: str, overrides: list[str], *, steps: int, workdir: Path, log_interval: int = 1
) -> list[dict]:
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    cfg = load_config(
        config,
        [
            *overrides,
            f"--metrics.run_dir={run_dir}",
            f"--train.max_steps={steps}",
            f"--metrics.log_interval={log_interval}",
            "--metrics.plot=false",
            "--checkpoint.interval=0",
            "--checkpoint.save_final=false",
            "--data.num_workers=0",
        ],
        world_size=1,
    )
    Trainer(cfg).train()
    return read_metrics(run_dir / "metrics.jsonl")


def steady(records: list[dict], skip: set[int] = frozenset()) -> float:
    values = [r["tokens_per_sec"] for r in records[2:] if r["step"] not in skip]
    return statistics.mean(values)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/train/demo.toml")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--log-interval", type=int, default=1, help="logged steps (1: every step, the harshest)"
    )
    args, extra = parser.parse_known_args()
    workdir = Path(tempfile.mkdtemp(prefix="kiln-logging-overhead-"))
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    traced, untraced = [], []
    first, last = PROFILED
    profile = [
        "--profiling.enabled=true",
        f"--profiling.start_step={first}",
        f"--profiling.end_step={last}",
    ]
    for _ in range(args.repeats):
        for name, overrides in VARIANTS.items():
            results[name].append(
                steady(
                    run(
                        args.config,
                        [*extra, *overrides],
                        steps=args.steps,
                        workdir=workdir,
                        log_interval=args.log_interval,
                    )
                )
            )
        records = run(args.config, [*extra, *profile], steps=args.steps, workdir=workdir)
        # A record's window ends at its step: the traced steps are first..last; the step after
        # `last` also pays for writing the trace.
        in_trace = set(range(first, last + 1))
        traced.append(
            statistics.mean(r["tokens_per_sec"] for r in records if r["step"] in in_trace)
        )
        untraced.append(steady(records, skip=in_trace | {last + 1}))
    base = statistics.median(results["JSONL only"])
    print("| logging | tok/s (median of repeats) | per-repeat | vs JSONL only |")
    print("|---|---|---|---|")
    for name, values in results.items():
        median = statistics.median(values)
        each = ", ".join(f"{v:,.0f}" for v in values)
        print(f"| {name} | {median:,.0f} | {each} | {100 * (base / median - 1):+.1f}% step time |")
    t, u = statistics.median(traced), statistics.median(untraced)
    print()
    print(
        f"profiler (steps {first}-{last} traced): traced steps {t:,.0f} tok/s, untraced steps "
        f"{u:,.0f} tok/s: {100 * (u / t - 1):+.1f}% step time on the traced steps"
    )


if __name__ == "__main__":
    main()
