"""Per-block compile against eager on CPU, layout by layout: steady step throughput, the cold
start (compile included), and how close the compiled run's numbers stay to the eager run's.

Each layout trains the debug recipe (seq 64, fp32, 1 thread per rank, the built-in corpus) eagerly
and compiled, alternating round by round with the order flipped each round; a run's throughput is
the median `tokens_per_sec` of the steps after --skip, the ratio compiled/eager is taken per round
and the median round reported. Parity is read from the first round's pair: the largest relative
difference over the steps of the loss, the gradient norm and any parameter's gradient norm (a
parameter's against the larger of its own norm and 1e-3 of the step's global norm, as the parity
suite does). Inductor's cache is a fresh directory per run, so every compiled run compiles cold.

    python benchmarks/compile.py --rounds 2 --steps 30 --skip 10 --out benchmarks/compile.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.launch import train_records

MOE = "--model.preset=debug_moe"
FP8_ROWWISE = ("--train.mixed_precision=fp8", "--fp8.high_precision=fp32", "--fp8.recipe=rowwise")
# name: (ranks, overrides)
LAYOUTS = {
    "one process": (1, ["--train.batch_size=8"]),
    "dp_shard=2": (2, ["--train.batch_size=4"]),
    "tp=2": (2, ["--distributed.tp=2", "--train.batch_size=8"]),
    "tp=2, FP8 rowwise": (2, ["--distributed.tp=2", "--train.batch_size=8", *FP8_ROWWISE]),
    "tp=2, MoE": (2, ["--distributed.tp=2", "--train.batch_size=8", MOE]),
    "cp=2": (2, ["--distributed.cp=2", "--train.batch_size=8"]),
    "cp=2 x tp=2, MoE": (
        4,
        ["--distributed.cp=2", "--distributed.tp=2", "--train.batch_size=8", MOE],
    ),
    "pp=2 x tp=2": (4, ["--distributed.pp=2", "--distributed.tp=2", "--train.batch_size=8"]),
}


def run(ranks: int, overrides: list[str], *, compiled: bool, args: argparse.Namespace) -> dict:
    """One `kiln train` run: its records and wall time, Inductor's cache cold."""
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
        start = time.perf_counter()
        records = train_records(
            ranks,
            *overrides,
            "--train.seq_len=64",
            "--data.num_workers=0",
            "--metrics.log_interval=1",
            "--metrics.param_grad_norms=true",
            f"--train.compile={str(compiled).lower()}",
            run_dir=Path(tmp) / "run",
            steps=args.steps,
            data=args.data,
        )
        wall = time.perf_counter() - start
    steady = [r["tokens_per_sec"] for r in records if r["step"] > args.skip]
    return {"records": records, "wall_s": wall, "tok_s": statistics.median(steady)}


def largest_differences(compiled: list[dict], eager: list[dict]) -> dict[str, float]:
    """Largest relative differences over the steps (see the module docstring)."""
    worst = {"loss": 0.0, "grad_norm": 0.0, "param_grad_norm": 0.0}
    for a, b in zip(compiled, eager, strict=True):
        for key in ("loss", "grad_norm"):
            worst[key] = max(worst[key], abs(a[key] - b[key]) / abs(b[key]))
        floor = 1e-3 * b["grad_norm"]
        for name, value in b["param_grad_norms"].items():
            gap = abs(a["param_grad_norms"][name] - value) / max(abs(value), floor)
            worst["param_grad_norm"] = max(worst["param_grad_norm"], gap)
    return worst


def measure(name: str, args: argparse.Namespace) -> dict:
    ranks, overrides = LAYOUTS[name]
    ratios, pairs = [], []
    for round_ in range(args.rounds):
        order = (True, False) if round_ % 2 == 0 else (False, True)
        pair = {c: run(ranks, overrides, compiled=c, args=args) for c in order}
        ratios.append(pair[True]["tok_s"] / pair[False]["tok_s"])
        pairs.append(pair)
    first = pairs[0]
    return {
        "layout": name,
        "ranks": ranks,
        "eager_tok_s": statistics.median(p[False]["tok_s"] for p in pairs),
        "compiled_tok_s": statistics.median(p[True]["tok_s"] for p in pairs),
        "ratio": statistics.median(ratios),
        "eager_wall_s": statistics.median(p[False]["wall_s"] for p in pairs),
        "compiled_wall_s": statistics.median(p[True]["wall_s"] for p in pairs),
        "differences": largest_differences(first[True]["records"], first[False]["records"]),
    }


def table(results: list[dict]) -> str:
    lines = [
        "| layout | ranks | eager tok/s | compiled tok/s | compiled / eager | run wall s, eager / compiled (cold) | loss | grad norm | param grad norm |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        d = r["differences"]
        lines.append(
            f"| {r['layout']} | {r['ranks']} | {r['eager_tok_s']:,.0f} | {r['compiled_tok_s']:,.0f} "
            f"| {r['ratio']:.2f}x | {r['eager_wall_s']:.0f} / {r['compiled_wall_s']:.0f} "
            f"| {d['loss']:.1e} | {d['grad_norm']:.1e} | {d['param_grad_norm']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default="data/demo", help="a prepared corpus (kiln prepare --demo)"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=10, help="steps left out of the throughput")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", nargs="*", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    results = []
    for name in args.only:
        results.append(measure(name, args))
        print(f"{name}: {results[-1]['ratio']:.2f}x", flush=True)
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
