"""Checkpoints through the training loop: what a save costs the steps around it, sync against
async (DCP's writer in a thread of the training process, or in a process of its own), and what
the commit's fsyncs add.

Each arm is `Trainer.train()` as `kiln train` runs it (one process, the demo corpus), saving every
`--interval` steps. The time between the ends of consecutive steps is recorded (the benchmark
wraps `Trainer.train_step`; kiln is not changed), so the interval after a save's step holds what
the save blocked plus the next step's compute, while an async write runs beside it. The
`checkpoint` events of `events.jsonl` give each save's blocked and write time and the step after
which it was committed. The `async_process` arm (`checkpoint.async_mode = "async_process"`: DCP's
writer in a process of its own, fed through shared memory) needs a process group, so with it
every arm runs in a one-rank gloo world. The fsync arm times `layout.commit` (rank 0's commit: fsyncs, marker,
rename, `latest`) with the fsyncs and, in the same run, with them replaced by a no-op.

    OMP_NUM_THREADS=2 python benchmarks/checkpoint_loop.py --preset debug --steps 24 --interval 4
    OMP_NUM_THREADS=2 python benchmarks/checkpoint_loop.py --preset llama3_125m --steps 12 --interval 4
    OMP_NUM_THREADS=1 python benchmarks/checkpoint_loop.py --modes sync,async,async_process --no-commit
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from kiln.checkpoint import layout, saver, store
from kiln.config import load_config
from kiln.data.demo_corpus import ensure_demo_corpus
from kiln.events import read_events
from kiln.train.trainer import Trainer

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "train" / "debug.toml"


def overrides_for(args, data: Path, run_dir: Path, mode: str) -> list[str]:
    return [
        f"--model.preset={args.preset}",
        f"--data.path={data}",
        f"--metrics.run_dir={run_dir}",
        "--data.num_workers=0",
        "--metrics.plot=false",
        f"--train.max_steps={args.steps}",
        f"--train.seq_len={args.seq_len}",
        f"--train.batch_size={args.batch_size}",
        "--scheduler.warmup_steps=1",
        f"--checkpoint.interval={args.interval}",
        "--checkpoint.keep_last_n=2",
        f"--checkpoint.async_mode='{'disabled' if mode == 'sync' else mode}'",
    ]


def run_arm(args, data: Path, run_dir: Path, mode: str) -> dict:
    """Train with saves in `mode`; per-step intervals and the checkpoint events."""
    overrides = overrides_for(args, data, run_dir, mode)
    ends: list[float] = []
    trainer = Trainer(load_config(RECIPE, overrides, world_size=1))
    real_step = trainer.train_step

    def timed_step(**flags):
        result = real_step(**flags)
        ends.append(time.perf_counter())
        return result

    trainer.train_step = timed_step
    trainer.train()
    intervals = {step: ends[step - 1] - ends[step - 2] for step in range(2, len(ends) + 1)}
    events = [e for e in read_events(run_dir) if e["event"] == "checkpoint"]
    return {"intervals": intervals, "events": events}


def dispatch_probe(args, data: Path, run_dir: Path, mode: str) -> dict:
    """The host side of a GPU step, alone on its core: how fast the training thread dispatches
    tiny ops (the launch work of a step whose kernels run on the device) before and while a
    background save of the model's state is written. A warm-up save first starts DCP's writer
    process (process mode) and allocates the staging buffer."""
    trainer = Trainer(load_config(RECIPE, overrides_for(args, data, run_dir, mode), world_size=1))
    x = torch.zeros(16)

    def chunk_s() -> float:
        started = time.perf_counter()
        for _ in range(2000):
            x.add_(1.0)
        return time.perf_counter() - started

    trainer.save()
    trainer.checkpoints.finish_save(after_step=trainer.step)
    before = [chunk_s() for _ in range(100)]
    trainer.step += 1
    trainer.save()
    started, beside = time.perf_counter(), []
    while not trainer.checkpoints.written_locally():
        beside.append(chunk_s())
    written = time.perf_counter() - started
    trainer.checkpoints.finish_save(after_step=trainer.step)
    trainer.checkpoints.saver.close(after_step=trainer.step)
    return {
        "dispatch_us_before": statistics.median(before) / 2000 * 1e6,
        "dispatch_us_beside_write": statistics.median(beside) / 2000 * 1e6 if beside else None,
        "probe_write_s": written,
    }


def one_rank_world() -> None:
    """A one-rank gloo world: DCP's process-based writer broadcasts its address over it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)


def summarize(arm: dict, interval: int, steps: int) -> dict:
    """Steps right after a save's step (they carry what the save blocked), the other steps that
    ran beside a background write, and the steps with no save around them; the first steps
    (warm-up) and the final save are left out."""
    saves = [e for e in arm["events"] if e["step"] < steps]
    writing = {s for e in saves for s in range(e["step"] + 2, e["committed_after_step"] + 1)}
    after_save = [t for s, t in arm["intervals"].items() if s > 2 and (s - 1) % interval == 0]
    beside = [t for s, t in arm["intervals"].items() if s in writing and (s - 1) % interval]
    plain = [
        t for s, t in arm["intervals"].items() if s > 2 and (s - 1) % interval and s not in writing
    ]
    return {
        "step_after_save_s": statistics.median(after_save),
        "step_beside_write_s": statistics.median(beside) if beside else None,
        "step_plain_s": statistics.median(plain),
        "first_write_s": saves[0]["write_s"],
        "blocked_s": statistics.median(e["blocked_s"] for e in saves),
        "write_s": statistics.median(e["write_s"] for e in saves),
        "committed_steps_later": statistics.median(
            e["committed_after_step"] - e["step"] for e in saves
        ),
    }


def commit_cost(args, data: Path, root: Path) -> dict:
    """Median time of rank 0's commit with the fsyncs and with them a no-op, arms alternating."""
    times: dict[str, list[float]] = {"fsync": [], "no fsync": []}
    # The filesystem's commit (LocalStore.publish) calls store.sync_path.
    real_commit, real_sync = layout.commit, store.sync_path

    def timed_commit(commit_root, step):
        started = time.perf_counter()
        final = real_commit(commit_root, step)
        times[current].append(time.perf_counter() - started)
        return final

    saver.layout.commit = timed_commit
    try:
        for round_ in range(args.rounds):
            for current in ("fsync", "no fsync") if round_ % 2 == 0 else ("no fsync", "fsync"):
                store.sync_path = real_sync if current == "fsync" else (lambda path: None)
                run_arm(args, data, root / f"commit_{round_}_{current}", "sync")
    finally:
        layout.commit, store.sync_path = real_commit, real_sync
    return {name: statistics.median(values) for name, values in times.items()}


def median_or_none(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each arm, alternating")
    parser.add_argument("--modes", default="sync,async", help="arms: sync, async, async_process")
    parser.add_argument("--no-commit", action="store_true", help="skip the fsync arm")
    parser.add_argument("--probe", action="store_true", help="dispatch probe, no training arms")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if "async_process" in modes:
        one_rank_world()
    with tempfile.TemporaryDirectory(prefix="kiln-ckpt-loop-") as scratch:
        root = Path(scratch)
        data = ensure_demo_corpus(root / "demo", max_bytes=2_000_000)
        results: dict[str, list[dict]] = {mode: [] for mode in modes}
        for round_ in range(args.rounds):
            for mode in modes if round_ % 2 == 0 else modes[::-1]:
                run_dir = root / f"{mode}_{round_}"
                if args.probe:
                    results[mode].append(dispatch_probe(args, data, run_dir, mode))
                    continue
                arm = run_arm(args, data, run_dir, mode)
                results[mode].append(summarize(arm, args.interval, args.steps))
        report = {
            mode: {key: median_or_none([r[key] for r in rounds]) for key in rounds[0]}
            | {"rounds": rounds}
            for mode, rounds in results.items()
        }
        if not (args.no_commit or args.probe):
            report["commit"] = commit_cost(args, data, root)
    print(json.dumps({"args": vars(args), **report}, indent=1))


if __name__ == "__main__":
    main()
