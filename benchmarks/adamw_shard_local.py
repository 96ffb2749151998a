"""ShardLocalAdamW (kiln/train/adamw.py) against torch.optim.AdamW on FSDP DTensors, CPU, gloo.

step  under torchrun, FSDP dp_shard = ranks, one thread per rank, the debug model (fp32, grads
      from one forward and backward, as benchmarks/optimizers.py builds it): one
      `optimizer.step()` of torch.optim.AdamW (foreach, what kiln built before) and of
      ShardLocalAdamW on the same weights, alternated, each after a barrier. Per repeat the
      slowest rank's time and the ratio of the two; the first step (cold) apart, and the first
      step of a second model built in the same process (as the test gangs run job after job).
job   `kiln train` with dp_shard=2 under torchrun (OMP_NUM_THREADS=1), configs/train/debug.toml
      with the parity tests' settings (tests/distributed/parity.py: 10 steps, seq_len 64, batch
      4 per rank, clipping, per-parameter grad norms, no checkpoint), with ShardLocalAdamW or
      with torch.optim.AdamW put back in its place (`train --optimizer torch`); the arms
      alternated; wall time of each job, start to exit, and rank 0's optimizer steps. Checks
      that both arms log bitwise the same losses and gradient norms at every step.
all   (default) both, then prints the medians and ratios.

    python benchmarks/adamw_shard_local.py --repeats 20 --jobs 3
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

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
MARK = "RESULT "
ARMS = ("torch", "local")
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def torch_adamw(params, *, fused: bool = False, **settings):
    """torch.optim.AdamW as kiln built it before ShardLocalAdamW."""
    import torch

    foreach = None if fused else True
    return torch.optim.AdamW(params, **settings, fused=True if fused else None, foreach=foreach)


def step(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    from optimizers import build  # benchmarks/optimizers.py: debug model with gradients

    from kiln.config import load_config
    from kiln.parallel.mesh import init_parallel
    from kiln.train.adamw import ShardLocalAdamW
    from kiln.train.optimizer import _decay_groups, _trainable

    world = int(os.environ["WORLD_SIZE"])
    layout = load_config(None, [f"--distributed.dp_shard={world}"])
    parallel = init_parallel(layout.distributed, torch.device("cpu"))

    def optimizers() -> dict:
        cfg, model = build("debug", parallel)
        o = cfg.optimizer
        settings = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps)
        groups = lambda: _decay_groups(_trainable(model), o.weight_decay)  # noqa: E731
        local = ShardLocalAdamW(groups(), **settings)
        return {"torch": torch_adamw(groups(), **settings), "local": local}

    def timed_round(arms: dict, order: list[str]) -> dict:
        row = {}
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            arms[name].step()
            row[name] = time.perf_counter() - start
        return row

    arms = optimizers()
    # Round 0 is the first step of each arm, local's first: the costs the two share the first
    # time (DTensor dispatch of zeros_like for the state) fall on local's. Then alternated.
    rounds = [timed_round(arms, sorted(arms, reverse=r % 2 == 1)) for r in range(args.repeats + 1)]
    # The first step of a second model in the same process, as a gang runs job after job
    # (tests/distributed/workers.py): DTensor's caches are warm, the state is new.
    rounds.append(timed_round(optimizers(), ["local", "torch"]))
    gathered = [None] * world
    dist.all_gather_object(gathered, rounds)
    dist.barrier()  # a rank that tore its group down early was seen to abort the other's exit
    dist.destroy_process_group()
    if parallel.is_main:  # per repeat, the slowest rank
        slowest = [{a: max(r[i][a] for r in gathered) for a in arms} for i in range(len(rounds))]
        print(MARK + json.dumps(slowest), flush=True)


def train(args: argparse.Namespace, kiln_args: list[str]) -> int:
    """`kiln train` with the chosen AdamW in the place of ShardLocalAdamW, its steps timed; rank
    0 prints their times."""
    import kiln.train.optimizer as built
    from kiln.cli import main

    make = torch_adamw if args.optimizer == "torch" else built.ShardLocalAdamW
    seconds: list[float] = []

    def timed_adamw(*a, **kw):
        optimizer = make(*a, **kw)
        untimed = optimizer.step

        def step(*sa, **skw):
            start = time.perf_counter()
            result = untimed(*sa, **skw)
            seconds.append(time.perf_counter() - start)
            return result

        optimizer.step = step
        return optimizer

    built.ShardLocalAdamW = timed_adamw
    code = main(["train", *kiln_args])
    if os.environ.get("RANK") == "0":
        print(MARK + json.dumps(seconds), flush=True)
    return code


def job(optimizer: str, data: str, run_dir: str) -> dict:
    """One `kiln train` job: its wall time, rank 0's optimizer steps and its metric records."""
    kiln_args = [
        *("configs/train/debug.toml", f"--data.path={data}", f"--metrics.run_dir={run_dir}"),
        *("--train.max_steps=10", "--metrics.log_interval=1", "--metrics.param_grad_norms=true"),
        *("--metrics.plot=false", "--train.grad_clip_norm=0.5", "--train.seq_len=64"),
        *("--data.num_workers=0", "--checkpoint.interval=0", "--checkpoint.save_final=false"),
        *("--distributed.dp_shard=2", "--train.batch_size=4"),
    ]
    command = [*TORCHRUN, __file__, "train", "--optimizer", optimizer, "--", *kiln_args]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=ONE_THREAD, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"job failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    # Each step's time from its record (log_interval 1: a record's window is one step).
    seconds, seen = [], 0
    for r in records:
        seconds.append((r["tokens_seen"] - seen) / r["tokens_per_sec"])
        seen = r["tokens_seen"]
    # What the optimizer decides: the timing fields differ from run to run.
    kept = ("step", "loss", "grad_norm", "lr", "param_grad_norms")
    return {
        "wall": wall,
        "train_steps": seconds,
        "steps": result(done.stdout),
        "records": [{k: r.get(k) for k in kept} for r in records],
    }


def result(stdout: str):
    return json.loads(
        [line for line in stdout.splitlines() if line.startswith(MARK)][-1][len(MARK) :]
    )


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def run_all(args: argparse.Namespace) -> None:
    from kiln.data.demo_corpus import ensure_demo_corpus

    print(f"step: load {os.getloadavg()[0]:.2f}, {args.repeats} repeats", flush=True)
    command = [*TORCHRUN, __file__, "step", "--repeats", str(args.repeats)]
    done = subprocess.run(command, cwd=REPO, env=ONE_THREAD, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"step failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    first, *rounds, again = result(done.stdout)
    ms = {a: statistics.median(1e3 * r[a] for r in rounds) for a in ARMS}
    print(
        f"one optimizer step, slowest of 2 ranks, median ms: torch {ms['torch']:.1f}, local "
        f"{ms['local']:.1f}, local / torch {_ratio([r['local'] / r['torch'] for r in rounds])}; "
        f"first step: torch {1e3 * first['torch']:.0f}, local {1e3 * first['local']:.0f}; "
        f"first step of a second model in the process: torch {1e3 * again['torch']:.1f}, "
        f"local {1e3 * again['local']:.1f}",
        flush=True,
    )
    runs: dict[str, list[dict]] = {a: [] for a in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        data = str(ensure_demo_corpus(os.path.join(tmp, "demo"), max_bytes=2_000_000))
        for repeat in range(args.jobs):
            for arm in sorted(ARMS, reverse=repeat % 2 == 1):
                runs[arm].append(job(arm, data, os.path.join(tmp, f"{arm}-{repeat}")))
                steps = runs[arm][-1]["steps"]
                print(
                    f"job {arm}: {runs[arm][-1]['wall']:.2f} s, optimizer steps "
                    f"{1e3 * sum(steps):.0f} ms (first {1e3 * steps[0]:.0f}), "
                    f"load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    # Both arms must train the same: bitwise equal losses and gradient norms at every step.
    same = all(r["records"] == runs["torch"][0]["records"] for a in ARMS for r in runs[a])
    for label, value in (
        ("job wall s", lambda r: r["wall"]),
        ("training steps 1-10 s", lambda r: sum(r["train_steps"])),
        (
            "training step ms, steps 2-10 (median)",
            lambda r: 1e3 * statistics.median(r["train_steps"][1:]),
        ),
        ("optimizer ms per job (10 steps)", lambda r: 1e3 * sum(r["steps"])),
        ("optimizer ms, first step", lambda r: 1e3 * r["steps"][0]),
        ("optimizer ms, steps 2-10 (median)", lambda r: 1e3 * statistics.median(r["steps"][1:])),
    ):
        values = {a: [value(r) for r in runs[a]] for a in ARMS}
        ratios = [b / a for a, b in zip(values["torch"], values["local"], strict=True)]
        print(
            f"{label}: torch {statistics.median(values['torch']):.2f}, local "
            f"{statistics.median(values['local']):.2f}, local / torch {_ratio(ratios)}"
        )
    print(f"records (loss, grad norms) bitwise equal in every job: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", nargs="?", choices=("all", "step", "train"), default="all")
    parser.add_argument("--repeats", type=int, default=20, help="step: timed steps per arm")
    parser.add_argument("--jobs", type=int, default=3, help="all: kiln train jobs per arm")
    parser.add_argument("--optimizer", choices=("torch", "local"), default="local")
    args, rest = parser.parse_known_args()
    if args.mode == "train":
        sys.exit(train(args, [a for a in rest if a != "--"]))
    step(args) if args.mode == "step" else run_all(args)


if __name__ == "__main__":
    main()
