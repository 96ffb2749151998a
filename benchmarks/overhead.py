"""kiln's per-step overhead on CPU against a minimal hand-written PyTorch loop.

Both sides train the same model (kiln's Transformer, same init) on the same batch shape with the
same thread count: forward, token cross entropy, backward, gradient clipping, AdamW (foreach).
The kiln side is `Trainer.train_step` as `kiln train` runs it (memory-mapped data, valid-token
normalization, LR schedule); the baseline reads a batch already in memory. The difference of
the two medians is kiln's fixed cost per step; a model too small to compute much (the TINY
overrides in benchmarks/overhead.md) shows it alone. --profile also counts the Python calls of
each side per step and lists where kiln's own time goes (cProfile, after the timed repeats).

    python benchmarks/overhead.py --steps 30 --repeats 7 [--config RECIPE] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from kiln.config import load_config
from kiln.model import build_model, materialize
from kiln.train.trainer import Trainer


def endless_trainer(config: str, overrides: list[str]) -> Trainer:
    """A `Trainer` of `config` with `overrides` in a fresh run dir, no checkpoints, and a
    learning-rate schedule that keeps going (nothing ends the run): one arm of a side-by-side
    comparison of steps."""
    run_dir = tempfile.mkdtemp(prefix="kiln-bench-")
    cfg = load_config(
        config, [*overrides, f"--metrics.run_dir={run_dir}", "--checkpoint.interval=0"]
    )
    cfg.train.max_steps = 10**9
    return Trainer(cfg)


def alternate_blocks(trainers: dict, *, steps: int, repeats: int) -> dict[str, list[float]]:
    """Per arm, the mean step time of each of `repeats` blocks of `steps` steps, the arms taking
    turns block by block so that drift in the machine's load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(repeats):
        for name, run in trainers.items():
            times[name].append(time_steps(run.train_step, steps))
    return times


def time_steps(step_fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step_fn()
    return (time.perf_counter() - start) / steps


def profile_steps(step_fn, steps: int, top: int = 0) -> str:
    """Python calls per step under cProfile, and the `top` functions by their own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step_fn()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    out.write(f"{stats.total_calls / steps:,.0f} Python calls per step\n")
    if top:
        stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def mean_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def baseline_step_fn(cfg, batch: torch.Tensor, *, model=None, loss_fn=mean_token_loss):
    """The hand-written step: `model` (kiln's, by default) and `loss_fn(logits, labels)`, the
    gradient clipped, AdamW (foreach)."""
    if model is None:
        model = materialize(build_model(cfg.model), device="cpu", seed=cfg.train.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.optimizer.lr, betas=tuple(cfg.optimizer.betas), foreach=True
    )
    inputs, labels = batch[:, :-1], batch[:, 1:]

    def step():
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per repeat")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="also cProfile both sides")
    args, overrides = parser.parse_known_args()  # the rest: --section.key=value for both sides
    args.overrides = overrides

    run_dir = tempfile.mkdtemp(prefix="kiln-overhead-")
    cfg = load_config(
        args.config, [*args.overrides, f"--metrics.run_dir={run_dir}", "--checkpoint.interval=0"]
    )
    cfg.train.max_steps = 10**9  # the LR schedule keeps going; nothing here ends the run
    trainer = Trainer(cfg)
    (first,) = trainer.loader.next_step().micro_batches
    batch = torch.cat([first[0], first[1][:, -1:]], dim=1)
    baseline = baseline_step_fn(cfg, batch)

    kiln_times, base_times = [], []
    time_steps(trainer.train_step, args.warmup)
    time_steps(baseline, args.warmup)
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits both sides alike
        kiln_times.append(time_steps(trainer.train_step, args.steps))
        base_times.append(time_steps(baseline, args.steps))

    kiln_ms, base_ms = 1e3 * statistics.median(kiln_times), 1e3 * statistics.median(base_times)
    tokens = cfg.train.batch_size * cfg.train.seq_len * cfg.train.grad_accum_steps
    print(
        f"config {args.config} {' '.join(args.overrides)}: {tokens} tokens/step, {torch.get_num_threads()} threads"
    )
    print("| loop | median step (ms) | min (ms) | max (ms) | tok/s |")
    print("|---|---|---|---|---|")
    for name, times, ms in (
        ("hand-written PyTorch", base_times, base_ms),
        ("kiln Trainer.train_step", kiln_times, kiln_ms),
    ):
        print(
            f"| {name} | {ms:.2f} | {1e3 * min(times):.2f} | {1e3 * max(times):.2f} | {tokens / ms * 1e3:,.0f} |"
        )
    print(
        f"\nkiln / hand-written = {kiln_ms / base_ms:.3f}x, kiln's fixed cost {kiln_ms - base_ms:.2f} ms/step"
    )
    if args.profile:
        print("\nhand-written:", profile_steps(baseline, args.steps))
        print("kiln:", profile_steps(trainer.train_step, args.steps, top=25))


if __name__ == "__main__":
    main()
