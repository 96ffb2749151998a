"""The gpt-oss debug shape's training step against a Llama MoE of the same size, on CPU, side by
side.

Three `Trainer`s of the debug recipe with `--model.preset=gpt_oss_debug` in one process:
  llama-moe     every gpt-oss option off (no attention or expert biases, no sinks, no window,
                plain SwiGLU, plain RoPE): the Llama MoE of the same widths and experts;
  gpt-oss       the preset as is (docs/models.md, "gpt-oss");
  gpt-oss, no sinks or window  the preset with full attention and no sinks: what the attention
                options cost apart from the biases and the clamp.
Warmed up, then blocks of `--steps` steps alternate between them `--repeats` times, so drift in
load hits all alike; per arm the median block's mean step time.

    PYTHONPATH=.:benchmarks python benchmarks/gpt_oss_step.py --data.path=data/demo --steps 20 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics

from overhead import alternate_blocks, endless_trainer, time_steps

from kiln.model import count_params

PLAIN_ATTENTION = [
    "--model.attention_sinks=false",
    "--model.sliding_window=0",
    "--model.layer_types=[]",
]
ARMS = {
    "llama-moe": [
        *PLAIN_ATTENTION,
        "--model.attention_bias=false",
        "--model.moe.bias=false",
        "--model.moe.activation=swiglu",
        "--model.rope_scaling=none",
    ],
    "gpt-oss": [],
    "gpt-oss, no sinks or window": PLAIN_ATTENTION,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    args, overrides = parser.parse_known_args()
    overrides = ["--model.preset=gpt_oss_debug", "--data.num_workers=0", *overrides]
    trainers = {
        name: endless_trainer(args.config, [*overrides, *extra]) for name, extra in ARMS.items()
    }
    for run in trainers.values():
        time_steps(run.train_step, args.warmup)
    times = alternate_blocks(trainers, steps=args.steps, repeats=args.repeats)
    base = statistics.median(times["llama-moe"])
    print(f"config {args.config} {' '.join(overrides)}")
    print("| arm | parameters | median step (ms) | min-max (ms) | step / llama-moe |")
    print("|---|---:|---:|---|---:|")
    for name, seconds in times.items():
        step = statistics.median(seconds)
        params = count_params(trainers[name].cfg.model).total
        print(
            f"| {name} | {params:,} | {1e3 * step:.1f} | {1e3 * min(seconds):.1f}-"
            f"{1e3 * max(seconds):.1f} | {step / base:.3f} |"
        )


if __name__ == "__main__":
    main()
