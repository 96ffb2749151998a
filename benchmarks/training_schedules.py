"""What the batch ramp and the sequence-length phases cost a step on CPU, side by side.

Four `Trainer`s of one recipe in one process, `--train.batch_size=B --train.grad_accum_steps=2`:
  fixed     no schedule: every step 2 micro-batches of B × seq_len;
  ramp-full a ramp already at the full batch (it ended at token 1): the same shape as fixed, so
            the ratio is the schedule's own bookkeeping (planning each step's shape);
  ramp-half a step ramp that holds half the batch for the whole measurement: 1 micro-batch;
  phase     a sequence-length phase at seq_len / 2 for the whole measurement, at the recipe's
            tokens per micro-batch (2B sequences of seq_len / 2).
Each is warmed up, then blocks of `--steps` steps alternate between them `--repeats` times, so
drift in machine load hits all alike; per arm the median block's mean step time, and tokens/s
from the tokens its steps read.

    PYTHONPATH=.:benchmarks python benchmarks/training_schedules.py --steps 20 --repeats 5 \
        [--config RECIPE] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import statistics

from overhead import alternate_blocks, endless_trainer, time_steps

from kiln.config import load_config

FAR = 10**15  # tokens: a schedule point no measurement reaches


def arms(batch_size: int, seq_len: int) -> dict[str, list[str]]:
    full = 2 * batch_size
    return {
        "fixed": [],
        "ramp-full": [
            "--train.batch_schedule.tokens=[0, 1]",
            f"--train.batch_schedule.sequences=[{batch_size}, {full}]",
        ],
        "ramp-half": [
            f"--train.batch_schedule.tokens=[0, {FAR}]",
            f"--train.batch_schedule.sequences=[{batch_size}, {full}]",
            "--train.batch_schedule.shape=step",
        ],
        "phase": [f"--train.seq_len_schedule=[{{seq_len={seq_len // 2}, until_tokens={FAR}}}]"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    args, overrides = parser.parse_known_args()
    cfg = load_config(args.config, overrides)
    overrides = [*overrides, f"--train.batch_size={cfg.train.batch_size}"]
    overrides += ["--train.grad_accum_steps=2", "--data.num_workers=0"]
    trainers = {
        name: endless_trainer(args.config, [*overrides, *extra])
        for name, extra in arms(cfg.train.batch_size, cfg.train.seq_len).items()
    }
    tokens = {}
    for name, run in trainers.items():
        time_steps(run.train_step, args.warmup)
        tokens[name] = run.train_step().tokens  # every later step reads as many
    times = alternate_blocks(trainers, steps=args.steps, repeats=args.repeats)
    fixed = statistics.median(times["fixed"])
    print(f"config {args.config} {' '.join(overrides)}")
    print(
        "| arm | tokens a step | median step (ms) | min-max (ms) | step / fixed | tok/s | tok/s / fixed |"
    )
    print("|---|---:|---:|---|---:|---:|---:|")
    for name, seconds in times.items():
        step = statistics.median(seconds)
        rate, fixed_rate = tokens[name] / step, tokens["fixed"] / fixed
        print(
            f"| {name} | {tokens[name]:,} | {1e3 * step:.1f} | {1e3 * min(seconds):.1f}-"
            f"{1e3 * max(seconds):.1f} | {step / fixed:.3f} | {rate:,.0f} | "
            f"{rate / fixed_rate:.3f} |"
        )


if __name__ == "__main__":
    main()
