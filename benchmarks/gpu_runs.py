"""kiln train on one GPU: throughput, MFU and peak memory for a few single-GPU settings.

The figures `kiln plan`'s model is held against where kiln itself ran (benchmarks/gpu_runs.md):
one model preset trained for --steps steps on the built-in corpus, every variant in its own
`kiln train` process, one after another. Throughput and MFU are the median of the logged records
after --skip steps (start-up and compilation excluded); peak memory is the largest
`torch.cuda.max_memory_allocated` logged (what the caching allocator handed out, not what it
reserved). With --profile, one more short run traces steps 6-7 with the memory history on, to
check that the CUDA memory snapshot is written.

    python benchmarks/gpu_runs.py --preset llama3_1b --seq 2048 --batch 4 --steps 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {
    "bf16, eager, AC none": ["--train.compile=false", '--train.activation_checkpointing="none"'],
    "bf16, compiled, AC none": ["--train.compile=true", '--train.activation_checkpointing="none"'],
    "bf16, compiled, AC selective": [
        "--train.compile=true",
        '--train.activation_checkpointing="selective"',
    ],
    "bf16, compiled, AC full": ["--train.compile=true", '--train.activation_checkpointing="full"'],
    "fp8 tensorwise, compiled, AC full": [
        "--train.compile=true",
        '--train.activation_checkpointing="full"',
        '--train.mixed_precision="fp8"',
        '--fp8.recipe="tensorwise"',
    ],
    "fp8 rowwise, compiled, AC full": [
        "--train.compile=true",
        '--train.activation_checkpointing="full"',
        '--train.mixed_precision="fp8"',
        '--fp8.recipe="rowwise"',
    ],
}


def train(args: argparse.Namespace, overrides: list[str], run_dir: Path) -> list[dict]:
    command = [
        sys.executable,
        "-m",
        "kiln",
        "train",
        "configs/train/demo.toml",
        f'--model.preset="{args.preset}"',
        f"--train.seq_len={args.seq}",
        f"--train.batch_size={args.batch}",
        f"--train.max_steps={args.steps}",
        '--train.mixed_precision="bf16"',
        f'--train.device="{args.device}"',
        "--scheduler.warmup_steps=5",
        "--checkpoint.interval=0",
        "--checkpoint.save_final=false",
        "--metrics.log_interval=1",
        "--metrics.plot=false",
        f'--metrics.run_dir="{run_dir}"',
        f'--data.path="{args.data}"',
        *overrides,
    ]
    subprocess.run(command, check=True)
    with open(run_dir / "metrics.jsonl") as records:
        return [json.loads(line) for line in records if '"tokens_per_sec"' in line]


def summary(records: list[dict], skip: int) -> tuple[float, float, float]:
    steady = [r for r in records if r["step"] > skip]
    return (
        statistics.median(r["tokens_per_sec"] for r in steady),
        statistics.median(r["mfu"] or 0.0 for r in steady),
        max(r["peak_mem_gb"] or 0.0 for r in records),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="llama3_1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=10, help="records left out of the medians")
    parser.add_argument("--data", default="data/demo")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test, no numbers to keep")
    parser.add_argument("--only", nargs="*", help="variant names to run (default: the bf16 ones)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=None, help="also write the table here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    rows = [
        f"{args.preset}, batch {args.batch} x {args.seq}, {args.steps} steps",
        "",
        "| variant | tok/s | MFU | peak allocated (GB) |",
        "|---|---:|---:|---:|",
    ]
    for i, (name, overrides) in enumerate(VARIANTS.items()):
        if name not in (args.only or [v for v in VARIANTS if v.startswith("bf16")]):
            continue
        tokens, mfu, peak = summary(train(args, overrides, work / f"v{i}"), args.skip)
        rows.append(f"| {name} | {tokens:,.0f} | {mfu:.1%} | {peak:.2f} |")
        print(rows[-1], flush=True)
    if args.profile:
        run_dir = work / "profiled"
        profiled = [
            "--profiling.enabled=true",
            "--profiling.start_step=6",
            "--profiling.end_step=7",
            "--profiling.record_memory=true",
            "--train.max_steps=8",
        ]
        train(args, profiled, run_dir)
        files = sorted(
            p.relative_to(run_dir) for p in (run_dir / "profile").rglob("*") if p.is_file()
        )
        rows += ["", "profiler output: " + ", ".join(map(str, files))]
    table = "\n".join(rows)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
