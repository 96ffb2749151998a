"""What replica groups cost and how fast they recover, on CPU (gloo), with real processes: a
torchft lighthouse and each replica group a job of its own, started as the fault-tolerance
tests start them (tests/support/lighthouse.py, tests/distributed/launch.py). The debug recipe,
seq_len 64, the demo corpus, no checkpoints. benchmarks/fault_tolerance.md reads it.

(a) Step time, side by side: plain HSDP (dp_replicate=2 × dp_shard=D, one job of 2·D ranks)
    against two replica groups of D ranks each (the same layout, the same global batch), both
    groups in the quorum from step 1 (lighthouse min_replicas=2), no failure. `--rounds`
    rounds alternate the two arms. A step's time is its tokens over its `tokens_per_sec`
    (metrics.jsonl, one record per step, the whole loop iteration); the median over the steps
    after the first `--skip`.
(b) Death: both groups train (min_replicas=1); all ranks of group 1 are SIGKILLed; the time to
    group 0's first quorum without it (events.jsonl `quorum`, participants=1) and to its next
    step in metrics.jsonl (polled every 10 ms).
(c) Rejoin: group 1 restarted; the time from its processes' start to its `quorum` event with
    healed=true (it took group 0's state there), and to its first logged step. The Python and
    torch start-up inside it is measured apart: `python -c` importing what `kiln train` imports
    before it reads its config (torch, torchft, kiln's trainer and CLI), same environment.
(b) and (c) repeat `--cycles` times with one lighthouse and one group 0.
(d) The cross-group sum after the backward, before and after issue 51's item 1: two replica
    groups of dp_shard=2 (min_replicas=2), each rank started by benchmarks/replica_sum_kiln.py,
    which times per step the wait on the cross-group sum after the backward, the cross-group
    all-reduces inside the backward, the forward/backward and the step. "before": every
    gradient shard summed after the backward (its --bench-after-backward); "after": kiln as
    shipped (each FSDP unit's shard from the all-reduce hook). `--sum-rounds` rounds alternate
    the arms, for each of `--sum-shapes` (the debug model, llama3_125m at batch 1).
(e), (f) DiLoCo's bytes across the groups and its loss: benchmarks/diloco_cost.py.

    PYTHONPATH=. .venv/bin/python benchmarks/fault_tolerance.py [--dp-shard 1] [--rounds 2]
        [--steps 60] [--cycles 3] [--parts a bc d e f] [--sum-shapes debug:20 llama3_125m:6]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch

from kiln.data.demo_corpus import ensure_demo_corpus
from kiln.events import read_events
from tests.distributed.launch import env, kiln_args, start_ranks, wait_all
from tests.support.lighthouse import HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS, lighthouse

IMPORTS = "import torch, torchft, kiln.cli, kiln.train.trainer"
DEMO_BYTES = 2_000_000  # the demo corpus's size here


def ft_args(address: str, group: int) -> list[str]:
    return [
        "--fault_tolerance.enabled=true",
        f"--fault_tolerance.lighthouse={address}",
        f"--fault_tolerance.replica_group={group}",
        "--fault_tolerance.quorum_timeout_s=30",
        "--fault_tolerance.timeout_s=30",
    ]


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.strip()]


def step_seconds(run_dir: Path, skip: int) -> list[float]:
    """Each logged step's seconds: its tokens (from tokens_seen) over its tokens_per_sec."""
    rows, out, seen = records(run_dir), [], 0
    for row in rows:
        tokens, seen = row["tokens_seen"] - seen, row["tokens_seen"]
        if row["step"] > skip:
            out.append(tokens / row["tokens_per_sec"])
    return out


def events(run_dir: Path, name: str, after: float = 0.0) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == name and e["time"] > after]


def wait_until(condition, procs, what: str, timeout: float = 180, poll: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a rank ended while waiting for {what}")
        time.sleep(poll)
    raise SystemExit(f"timed out waiting for {what}")


def step_time_arms(data: Path, root: Path, args, d: int) -> dict[str, list[float]]:
    """(a): median step seconds of each arm, one value per round, groups of `d` ranks."""
    layout = [
        "--distributed.dp_replicate=2",
        f"--distributed.dp_shard={d}",
        f"--train.max_steps={args.steps}",
        "--checkpoint.interval=0",
        "--scheduler.warmup_steps=0",
    ]
    out: dict[str, list[float]] = {"hsdp": [], "ft": []}
    for r in range(args.rounds):
        run = root / f"hsdp_{d}_{r}"
        procs = start_ranks(2 * d, kiln_args(run, data, *layout), root / f"logs_hsdp_{d}_{r}")
        assert wait_all(procs, timeout=600) == [0] * (2 * d), f"HSDP run failed: {root}"
        out["hsdp"].append(statistics.median(step_seconds(run, args.skip)))
        run = root / f"ft_{d}_{r}"
        with lighthouse(root / f"lighthouse_ft_{d}_{r}.txt", min_replicas=2) as house:
            groups = [
                start_ranks(
                    d,
                    kiln_args(run, data, *layout, *ft_args(house.address, g)),
                    root / f"logs_ft_{d}_{r}_{g}",
                )
                for g in (0, 1)
            ]
            codes = wait_all(groups[0] + groups[1], timeout=600)
            assert codes == [0] * (2 * d), f"fault-tolerance run failed: {root}"
        per_group = [
            statistics.median(step_seconds(run / f"replica_group_{g}", args.skip)) for g in (0, 1)
        ]
        out["ft"].append(statistics.median(per_group))
        print(
            f"dp_shard={d} round {r}: hsdp {out['hsdp'][-1] * 1e3:.1f} ms, ft {out['ft'][-1] * 1e3:.1f} ms",
            flush=True,
        )
    return out


# (d): the model shapes measured, and what each needs to fit a few minutes on two cores.
SUM_SHAPES = {
    "debug": [],
    "llama3_125m": ["--model.preset=llama3_125m", "--train.batch_size=1"],
}
SUM_ARMS = {"before": ["--bench-after-backward"], "after": []}
SUM_KEYS = ("after_backward", "in_backward", "forward_backward", "step")


def sum_wait_arms(data: Path, root: Path, args, shape: str) -> dict[str, list[dict]]:
    """(d): per round and arm, the median over steps and ranks of each timing that
    benchmarks/replica_sum_kiln.py records, and the step time from metrics.jsonl."""
    d, steps = 2, args.sum_shapes[shape]
    layout = [
        "--distributed.dp_replicate=2",
        f"--distributed.dp_shard={d}",
        f"--train.max_steps={steps}",
        "--checkpoint.interval=0",
        "--scheduler.warmup_steps=0",
        *SUM_SHAPES[shape],
    ]
    out: dict[str, list[dict]] = {arm: [] for arm in SUM_ARMS}
    for r in range(args.sum_rounds):
        for arm, flag in SUM_ARMS.items():
            run = root / f"sum_{shape}_{arm}_{r}"
            with lighthouse(root / f"lighthouse_{run.name}.txt", min_replicas=2) as house:
                groups = [
                    start_ranks(
                        d,
                        [*flag, *kiln_args(run, data, *layout, *ft_args(house.address, g))],
                        root / f"logs_{run.name}_{g}",
                        module="benchmarks.replica_sum_kiln",
                    )
                    for g in (0, 1)
                ]
                codes = wait_all(groups[0] + groups[1], timeout=600)
                assert codes == [0] * (2 * d), f"(d) run failed: {run}"
            out[arm].append(sum_round(run, d, args.sum_skip))
            print(
                f"{shape} round {r} {arm}: "
                + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in out[arm][-1].items()),
                flush=True,
            )
    return out


def sum_round(run: Path, d: int, skip: int) -> dict[str, float]:
    """One run's medians: each timing over the committed steps after `skip` and over every
    rank of both groups; the logged step time over the steps, then the groups."""
    ranks = []
    for g in (0, 1):
        for r in range(d):
            path = run / f"replica_group_{g}" / f"replica_sum_rank_{r}.json"
            ranks.append(json.loads(path.read_text())["steps"][skip:])
    assert all(s["committed"] for rank in ranks for s in rank), f"a step did not commit: {run}"
    medians = {k: statistics.median(s[k] for rank in ranks for s in rank) for k in SUM_KEYS}
    logged = [statistics.median(step_seconds(run / f"replica_group_{g}", skip)) for g in (0, 1)]
    return medians | {"logged_step": statistics.median(logged)}


def import_seconds(repeats: int = 3) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.time()
        subprocess.run([sys.executable, "-c", IMPORTS], env=env(), check=True)
        times.append(time.time() - start)
    return times


def kill_and_rejoin(data: Path, root: Path, args) -> list[dict]:
    """(b) and (c), `args.cycles` times."""
    d, run = args.dp_shard[0], root / "kill_run"
    base = kiln_args(
        run,
        data,
        "--distributed.dp_replicate=2",
        f"--distributed.dp_shard={d}",
        "--train.max_steps=100000",
        "--checkpoint.interval=0",
    )
    g0_dir, g1_dir = run / "replica_group_0", run / "replica_group_1"
    cycles = []
    with lighthouse(root / "lighthouse_kill.txt") as house:
        group_0 = start_ranks(d, [*base, *ft_args(house.address, 0)], root / "logs_kill_0")
        wait_until(lambda: records(g0_dir), group_0, "group 0's first step")
        started = time.time()
        group_1 = start_ranks(d, [*base, *ft_args(house.address, 1)], root / "logs_kill_1_0")
        for cycle in range(args.cycles):
            everyone = group_0 + group_1
            healed = wait_until(
                lambda s=started: [e for e in events(g1_dir, "quorum", s) if e["healed"]],
                everyone,
                "group 1 healed",
            )[0]
            first = wait_until(
                lambda s=healed["step"]: _step_at_least(g1_dir, s), everyone, "a step"
            )
            first_step_time = time.time()
            rejoin = {
                "healed_s": healed["time"] - started,
                "first_step_s": first_step_time - started,
            }
            # a few steps together, then group 1's node "fails": every rank at once
            together = first + args.steps_together
            wait_until(lambda t=together: _step_at_least(g0_dir, t), everyone, "steps together")
            last = records(g0_dir)[-1]["step"]
            for proc in group_1:
                proc.send_signal(signal.SIGKILL)
            died = time.time()
            wait_all(group_1, timeout=30)
            alone = wait_until(
                lambda t=died: [e for e in events(g0_dir, "quorum", t) if e["participants"] == 1],
                group_0,
                "group 0 alone",
            )[0]
            wait_until(lambda t=last: _step_at_least(g0_dir, t + 1), group_0, "group 0's next step")
            next_step = time.time()
            wait_until(lambda t=alone["step"]: _step_at_least(g0_dir, t), group_0, "the alone step")
            alone_step = time.time()
            lost = [e for e in events(g0_dir, "not_committed", died - 1)]
            cycles.append(
                rejoin
                | {
                    "alone_quorum_s": alone["time"] - died,
                    "next_step_s": next_step - died,
                    "alone_step_s": alone_step - died,
                    "not_committed_s": [round(e["time"] - died, 3) for e in lost],
                    "not_committed": [e["reason"][:80] for e in lost],
                }
            )
            print(f"cycle {cycle}: {cycles[-1]}", flush=True)
            if cycle + 1 < args.cycles:
                time.sleep(0.5)
                started = time.time()
                logs = root / f"logs_kill_1_{cycle + 1}"
                group_1 = start_ranks(d, [*base, *ft_args(house.address, 1)], logs)
        for proc in group_0:
            proc.send_signal(signal.SIGKILL)
        wait_all(group_0, timeout=30)
    return cycles


def _step_at_least(run_dir: Path, step: int) -> int | None:
    rows = records(run_dir)
    return rows[-1]["step"] if rows and rows[-1]["step"] >= step else None


def median_range(values: list[float], scale: float = 1.0, fmt: str = ".2f") -> str:
    values = [v * scale for v in values]
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line
        )
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    # Imported here: it imports this module's helpers.
    from benchmarks import diloco_cost

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp-shard", type=int, nargs="+", default=[1], help="ranks per group")
    parser.add_argument("--keep", default="", help="a folder to keep the runs and logs in")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of (a)")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--steps-together", type=int, default=3)
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("a", "bc", "d", "e", "f"),
        default=["a", "bc"],
        help="what to run",
    )
    parser.add_argument(
        "--sum-shapes",
        nargs="+",
        default=["debug:20"],
        help=f"(d): SHAPE:STEPS, SHAPE one of {', '.join(SUM_SHAPES)}",
    )
    parser.add_argument("--sum-rounds", type=int, default=2, help="(d): rounds of both arms")
    parser.add_argument("--sum-skip", type=int, default=2, help="(d): first steps left out")
    diloco_cost.add_arguments(parser)
    args = parser.parse_args()
    shapes = [s.partition(":") for s in args.sum_shapes]
    if any(shape not in SUM_SHAPES or not steps.isdigit() for shape, _, steps in shapes):
        parser.error(f"--sum-shapes: SHAPE:STEPS, SHAPE one of {', '.join(SUM_SHAPES)}")
    args.sum_shapes = {shape: int(steps) for shape, _, steps in shapes}
    print(
        f"device: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}; "
        f"torchft {version('torchft')}; "
        f"Python {platform.python_version()}; load average before: {os.getloadavg()}"
    )
    print(
        f"lighthouse: heartbeat_timeout_ms={HEARTBEAT_TIMEOUT_MS}, join_timeout_ms={JOIN_TIMEOUT_MS}"
    )
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        data = ensure_demo_corpus(root / "demo", max_bytes=DEMO_BYTES)
        arms = [step_time_arms(data, root, args, d) for d in args.dp_shard if "a" in args.parts]
        if "bc" in args.parts:
            imports = import_seconds()
            cycles = kill_and_rejoin(data, root, args)
        sums = {s: sum_wait_arms(data, root, args, s) for s in args.sum_shapes if "d" in args.parts}
        costs = diloco_cost.run(args, data, root)
    for d, arm in zip(args.dp_shard, arms, strict=False):
        step_table(d, arm, args)
    if "bc" in args.parts:
        cycle_table(cycles, imports)
    for shape, arm in sums.items():
        sum_table(shape, arm, args)
    diloco_cost.print_tables(costs, args)
    print(f"\nwall time {time.monotonic() - began:.0f} s; load average after: {os.getloadavg()}")


def step_table(d: int, arms: dict[str, list[float]], args) -> None:
    hsdp, ft = arms["hsdp"], arms["ft"]
    if not hsdp:
        return
    ratios = [f / h for f, h in zip(ft, hsdp, strict=True)]
    print(
        f"\n(a) step time, 2 × dp_shard={d}, median of steps > {args.skip} of {args.steps}, per round"
    )
    print("| arm | ms per step, median (min-max over rounds) |\n|---|---:|")
    print(f"| plain HSDP, one job of {2 * d} ranks | {median_range(hsdp, 1e3, '.1f')} |")
    print(f"| two replica groups of {d} | {median_range(ft, 1e3, '.1f')} |")
    print(
        f"ratio ft / hsdp per round: {', '.join(f'{r:.2f}' for r in ratios)}; "
        f"extra per step: {median_range([f - h for f, h in zip(ft, hsdp, strict=True)], 1e3, '.1f')} ms"
    )


def sum_table(shape: str, arms: dict[str, list[dict]], args) -> None:
    before, after = arms["before"], arms["after"]
    print(
        f"\n(d) {shape}, 2 groups × dp_shard=2, {args.sum_shapes[shape]} steps, the first "
        f"{args.sum_skip} left out; ms, median over rounds (min-max); ratio after / before per round"
    )
    print("| per step | before (sum after the backward) | after (item 1) | ratio per round |")
    print("|---|---:|---:|---|")
    for key, what in (
        ("after_backward", "wait on the cross-group sum after the backward"),
        ("in_backward", "cross-group all-reduces inside the backward"),
        ("forward_backward", "forward and backward"),
        ("step", "TrainStep call"),
        ("logged_step", "step, metrics.jsonl (tokens / tokens_per_sec)"),
    ):
        b, a = [r[key] for r in before], [r[key] for r in after]
        ratios = ", ".join(f"{y / x:.2f}" if x > 0 else "-" for x, y in zip(b, a, strict=True))
        print(
            f"| {what} | {median_range(b, 1e3, '.1f')} | {median_range(a, 1e3, '.1f')} | {ratios} |"
        )


def cycle_table(cycles: list[dict], imports: list[float]) -> None:
    print(f"\n(b), (c) over {len(cycles)} cycles, seconds, median (min-max)")
    print("| measure | s |\n|---|---:|")
    for key, what in (
        ("alone_quorum_s", "SIGKILL of group 1 → group 0's quorum without it"),
        ("next_step_s", "SIGKILL → group 0's next logged step"),
        ("alone_step_s", "SIGKILL → group 0's step of that quorum logged"),
        ("healed_s", "group 1's start → its healed quorum"),
        ("first_step_s", "group 1's start → its first logged step"),
    ):
        print(f"| {what} | {median_range([c[key] for c in cycles])} |")
    print(f"| `python -c '{IMPORTS}'` | {median_range(imports)} |")
    for c in cycles:
        print("group 0 not committed, s after the kill:", c["not_committed_s"], c["not_committed"])


if __name__ == "__main__":
    main()
