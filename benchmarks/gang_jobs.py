"""What one parity job costs on the test suite's gangs (tests/distributed/workers.py), by layout:
each layout's job at 1 step and at 10 steps, alternating, in one warm gang per world size. The
1-step job is mostly the job's fixed cost (rendezvous, mesh, model, first step); the difference
over nine steps is the cost of a step. benchmarks/test_suite.md reads it.

    PYTHONPATH=. .venv/bin/python benchmarks/gang_jobs.py --rounds 2

`--variant=ARGS` (e.g. `--variant=--distributed.reshard_after_forward=false`) also runs each
layout with those overrides in the same round, right after, for a side-by-side step cost. The
word `gloo` among them runs that arm on stock gloo instead of the test suite's shared-memory
arena (tests/support/accelerator.py), which the gang jobs use by default:

    PYTHONPATH=. .venv/bin/python benchmarks/gang_jobs.py --rounds 2 --variant=gloo
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kiln.data.demo_corpus import ensure_demo_corpus
from tests.distributed.parity import train_args
from tests.distributed.workers import Gangs, kiln_train

# name: (ranks, overrides)
LAYOUTS = {
    "one process": (1, ["--train.batch_size=8"]),
    "dp_shard=2": (2, ["--distributed.dp_shard=2", "--train.batch_size=4"]),
    "tp=2": (2, ["--distributed.tp=2", "--train.batch_size=8"]),
    "dp_shard=4": (4, ["--distributed.dp_shard=4", "--train.batch_size=2"]),
    "tp=2 x dp_shard=2": (4, ["--distributed.tp=2", "--train.batch_size=4"]),
    "tp=4": (4, ["--distributed.tp=4", "--train.batch_size=8", "--model.n_kv_heads=4"]),
}


def job_seconds(
    gangs: Gangs, root: Path, data: Path, layout: str, steps: int, variant: tuple[str, ...] = ()
) -> float:
    ranks, overrides = LAYOUTS[layout]
    run_dir = Path(tempfile.mkdtemp(dir=root)) / "run"
    extra = [*overrides, "--scheduler.warmup_steps=0", *(v for v in variant if v != "gloo")]
    args = train_args(run_dir, data, *extra, steps=steps)
    start = time.monotonic()
    gangs.run(ranks, kiln_train, args, shared_memory="gloo" not in variant)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variant", default="", help="overrides of a second arm, space-separated")
    options = parser.parse_args()
    rounds, variant = options.rounds, tuple(options.variant.split())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = ensure_demo_corpus(root / "demo", max_bytes=2_000_000)
        gangs = Gangs(root / "gangs")
        try:
            for layout in LAYOUTS:  # warm-up: each gang's first job imports what it needs
                job_seconds(gangs, root, data, layout, steps=1)
            header = "| layout | ranks | 1 step, s | 10 steps, s | a step, s |"
            print(header + (" a step, variant, s | variant / base |" if variant else ""))
            print("|---|---:|---:|---:|---:|" + ("---:|---:|" if variant else ""))
            for _ in range(rounds):
                for layout, (ranks, _overrides) in LAYOUTS.items():
                    one = job_seconds(gangs, root, data, layout, steps=1)
                    ten = job_seconds(gangs, root, data, layout, steps=10)
                    step = (ten - one) / 9
                    row = f"| {layout} | {ranks} | {one:.2f} | {ten:.2f} | {step:.3f} |"
                    if variant:
                        one = job_seconds(gangs, root, data, layout, 1, variant)
                        other = (job_seconds(gangs, root, data, layout, 10, variant) - one) / 9
                        row += f" {other:.3f} | {other / step:.2f} |"
                    print(row, flush=True)
        finally:
            gangs.close()


if __name__ == "__main__":
    main()
