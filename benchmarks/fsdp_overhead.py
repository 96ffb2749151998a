"""FSDP (dp_shard=2) against one process on CPU, same cores, same per-rank batch: what the FSDP
path costs beyond the compute it shards.

Two arms on a 29M-parameter Llama (dim 512, 8 layers, 8 heads, 4 KV heads, ffn 1536, vocab
4096, 4 x 256 tokens per rank, fp32, AdamW foreach), run in rounds (a b, b a, ...):

  (a) `kiln train` in one process with OMP_NUM_THREADS=2, batch_size=4;
  (b) torchrun --nproc-per-node=2, dp_shard=2, OMP_NUM_THREADS=1 per process, batch_size=4 per
      rank (twice the tokens per step on the same two cores).

Each run's throughput is the total tokens over the total time of the logged windows after
--skip steps (`tokens_per_sec` of metrics.jsonl; windows of equal token counts, so the harmonic
mean); the ratio b/a is taken round by round, so drift in machine load hits both arms alike.
`--variant ARGS` adds an arm (b) with more overrides to each round, to compare FSDP settings
side by side:

    python benchmarks/fsdp_overhead.py --pairs 3 --steps 24 --skip 8
    python benchmarks/fsdp_overhead.py --pairs 4 \
        --variant=--distributed.reshard_after_forward=false
    git worktree add /tmp/kiln-before HEAD~1
    python benchmarks/fsdp_overhead.py --pairs 4 --checkout /tmp/kiln-before

`profile` runs a few steps in-process under torch.profiler and prints the top ops and the time
per step of FSDP's own ranges, collectives and the optimizer (rank 0 under torchrun):

    OMP_NUM_THREADS=2 python benchmarks/fsdp_overhead.py profile
    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=2 \
        benchmarks/fsdp_overhead.py profile --distributed.dp_shard=2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = [
    "--model.dim=512",
    "--model.n_layers=8",
    "--model.n_heads=8",
    "--model.n_kv_heads=4",
    "--model.ffn_hidden_dim=1536",
    "--model.vocab_size=4096",
    "--train.seq_len=256",
    "--train.batch_size=4",
    "--train.mixed_precision=fp32",
    "--checkpoint.interval=0",
    "--checkpoint.save_final=false",
    "--metrics.plot=false",
    "--data.num_workers=0",
]
RECIPE = "configs/train/debug.toml"


def run_arm(
    arm: str, *, steps: int, log_interval: int, extra: list[str], checkout: str | None = None
) -> list[dict]:
    """One `kiln train` run of arm 'a' (one process, 2 threads) or 'b' (2 ranks, 1 thread each),
    with the kiln of this checkout, or of `checkout` (`python -m` imports from its directory)."""
    with tempfile.TemporaryDirectory(prefix="kiln-fsdp-overhead-") as tmp:
        if arm == "a":
            launcher, threads, layout = [], "2", []
        else:
            launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
            threads, layout = "1", ["--distributed.dp_shard=2"]
        command = [
            sys.executable,
            *launcher,
            "-m",
            "kiln",
            "train",
            RECIPE,
            *MODEL,
            *layout,
            f"--train.max_steps={steps}",
            f"--metrics.log_interval={log_interval}",
            f"--metrics.run_dir={tmp}/run",
            *extra,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": threads}
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=checkout)
        if done.returncode != 0:
            sys.exit(f"arm {arm} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        lines = (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]


def steady_tok_s(records: list[dict], *, skip: int, log_interval: int) -> float:
    """Tokens over time of the full windows after step `skip`: the harmonic mean of their tok/s
    (every full window holds the same number of tokens)."""
    windows = [
        r["tokens_per_sec"] for r in records if r["step"] > skip and r["step"] % log_interval == 0
    ]
    return len(windows) / sum(1 / w for w in windows)


def load_average() -> float:
    return os.getloadavg()[0]


def compare(args: argparse.Namespace, extra: list[str]) -> None:
    # Arm (b) as given, then one more arm (b) per --variant, with its overrides on top.
    arms = {"a": ("a", extra, None), "b": ("b", extra, None)}
    for index, variant in enumerate(args.variant, start=2):
        arms[f"b{index}"] = ("b", [*extra, *variant.split()], None)
    if args.checkout:
        arms["b-checkout"] = ("b", extra, args.checkout)
    rows = []
    names = list(arms)
    for pair in range(args.pairs):
        row = {"load": load_average()}
        # Each round starts one arm later, so no arm always runs in the same slot of a round.
        for name in names[pair % len(names) :] + names[: pair % len(names)]:
            arm, overrides, checkout = arms[name]
            records = run_arm(
                arm,
                steps=args.steps,
                log_interval=args.log_interval,
                extra=overrides,
                checkout=checkout,
            )
            row[name] = steady_tok_s(records, skip=args.skip, log_interval=args.log_interval)
        rows.append(row)
        ratios = ", ".join(f"{name}/a {row[name] / row['a']:.3f}" for name in arms if name != "a")
        speeds = ", ".join(f"{name} {row[name]:,.0f}" for name in arms)
        print(
            f"round {pair + 1}: {speeds} tok/s; {ratios} (load {row['load']:.2f} before)",
            flush=True,
        )
    print(f"\n{args.steps} steps, log interval {args.log_interval}, steps > {args.skip} counted")
    for index, variant in enumerate(args.variant, start=2):
        print(f"(b{index}): arm (b) with {variant}")
    if args.checkout:
        print(f"(b-checkout): arm (b) with the kiln of {args.checkout}")
    print("| arm | median tok/s | min | max | median ratio to (a), round by round |")
    print("|---|---|---|---|---|")
    for name in arms:
        values = [row[name] for row in rows]
        ratios = [row[name] / row["a"] for row in rows]
        print(
            f"| ({name}) | {statistics.median(values):,.0f} | {min(values):,.0f} | "
            f"{max(values):,.0f} | {statistics.median(ratios):.3f} |"
        )


def profile(args: argparse.Namespace, overrides: list[str]) -> None:
    """A few steps of the same Trainer `kiln train` builds, under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from kiln.config import load_config
    from kiln.train.trainer import Trainer

    run_dir = tempfile.mkdtemp(prefix="kiln-fsdp-profile-")
    cfg = load_config(RECIPE, [*MODEL, *overrides, f"--metrics.run_dir={run_dir}"])
    cfg.train.max_steps = 10**6  # the schedule keeps going; nothing here ends the run
    trainer = Trainer(cfg)
    for _ in range(args.warmup):
        trainer.train_step()
    started = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.profile_steps):
            trainer.train_step()
    seconds = (time.perf_counter() - started) / args.profile_steps
    # CPU seconds (all threads of this process) per step: unlike the wall clock, not inflated
    # when other jobs take the cores, and not counting the time a rank waits for its peer.
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(args.profile_steps):
        trainer.train_step()
    plain = (time.perf_counter() - started) / args.profile_steps
    cpu = (time.process_time() - cpu_started) / args.profile_steps
    # Every rank's own CPU time: the wall time it did not use is time spent waiting for a peer.
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    print(f"rank {rank}: {1e3 * plain:.0f} ms/step, {1e3 * cpu:.0f} ms CPU time", flush=True)
    if not trainer.parallel.is_main:
        return
    steps = args.profile_steps
    print(
        f"{' '.join(overrides) or 'one process'}: {torch.get_num_threads()} threads, "
        f"{1e3 * plain:.0f} ms/step unprofiled ({1e3 * cpu:.0f} ms CPU time on rank 0), "
        f"{1e3 * seconds:.0f} ms/step profiled (load {load_average():.1f})"
    )
    # FSDP names its ranges per unit ("FSDP::all_gather (layers.3.attention)"): summed per kind.
    grouped: dict[str, list[float]] = {}
    for event in prof.key_averages():
        name = event.key.split(" (")[0]
        total = grouped.setdefault(name, [0.0, 0.0, 0.0])
        total[0] += event.self_cpu_time_total / 1e3 / steps
        total[1] += event.cpu_time_total / 1e3 / steps
        total[2] += event.count / steps
    print(f"\n{'op or range (per step)':60s} {'self ms':>9s} {'total ms':>9s} {'calls':>7s}")
    ranked = sorted(grouped.items(), key=lambda item: -item[1][1])
    wanted = ("FSDP::", "Optimizer", "gloo:", "c10d::", "record_param_comms")
    shown = [item for item in ranked if item[0].startswith(wanted)]
    shown += sorted(grouped.items(), key=lambda item: -item[1][0])[: args.top]
    for name, (self_ms, total_ms, calls) in dict(shown).items():
        print(f"{name[:60]:60s} {self_ms:9.1f} {total_ms:9.1f} {calls:7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", nargs="?", choices=("compare", "profile"), default="compare")
    parser.add_argument("--pairs", type=int, default=3, help="rounds of the arms, alternating")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="one more arm (b) with these overrides, e.g. "
        "'--distributed.reshard_after_forward=false' (repeatable)",
    )
    parser.add_argument(
        "--checkout",
        help="one more arm (b) run with the kiln of another checkout, e.g. a git worktree of the "
        "commit before a change",
    )
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--log-interval", type=int, default=4)
    parser.add_argument("--skip", type=int, default=8, help="steps not counted (warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="profile: steps before profiling")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    args, extra = parser.parse_known_args()  # the rest: --section.key=value, both arms
    if args.mode == "profile":
        profile(args, extra)
    else:
        compare(args, extra)


if __name__ == "__main__":
    main()
