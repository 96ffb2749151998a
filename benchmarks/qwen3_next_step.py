"""A dense Qwen3-Next-shaped hybrid's training step against a Llama of the same parameter count,
on CPU, side by side at several sequence lengths.

The arms are `Trainer`s of configs/train/qwen3_next_debug.toml (fp32, AdamW, clip 1.0), dense
(no MoE) and without document masks, so the difference is the token mixers:
  hybrid  the qwen3_next_debug preset made dense (`--model.moe.num_experts=0`): 4 blocks of
          dim 128, three Gated DeltaNet layers (chunked torch kernel) then one gated full attention
          layer (4 heads of 64, 2 KV), each with a SwiGLU of 256;
  llama   the llama family at the same dim, blocks, vocabulary and SwiGLU, attention of
          4 heads of 64 with 1 KV head: the width that brings its total within 0.4 % of the
          hybrid's (a softmax layer holds more weights than a Gated DeltaNet layer);
  hybrid, all full attention  the hybrid with its three Gated DeltaNet layers made gated full
          attention layers: the control that isolates the linear layers (not size-matched).
Every sequence length keeps `--tokens` tokens a step (batch = tokens / seq). All arms are warmed
up, then blocks of `--steps` steps alternate between all of them `--repeats` times, so drift in
load hits all alike; per arm the median block's mean step time. Then one more step per arm under
torch.profiler gives its allocator peak (benchmarks/delta_rule.py's `peak_mib`).

    OMP_NUM_THREADS=1 PYTHONPATH=.:benchmarks python benchmarks/qwen3_next_step.py \
        --seq 256 1024 4096 --tokens 4096 --steps 2 --repeats 6
"""

from __future__ import annotations

import argparse
import statistics

import torch
from delta_rule import peak_mib
from overhead import alternate_blocks, endless_trainer, time_steps

from kiln.model import count_params, flops_per_token

CONFIG = "configs/train/qwen3_next_debug.toml"
COMMON = ["--data.document_mask=false", "--data.num_workers=0"]
DENSE = [
    "--model.moe.num_experts=0",  # and the MoE keys a dense model refuses
    "--model.moe.shared_experts=0",
    "--model.moe.shared_expert_gate=false",
    "--model.moe.aux_loss_weight=0",
]
ARMS = {
    "hybrid": DENSE,
    "hybrid, all full attention": [*DENSE, f"--model.layer_types={['full_attention'] * 4}"],
    "llama": [
        "--model.preset=debug",  # family llama; the keys below give the hybrid's shape
        "--model.n_layers=4",
        "--model.n_heads=4",
        "--model.head_dim=64",
        "--model.n_kv_heads=1",
        "--model.ffn_hidden_dim=256",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens a step at every seq")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args, overrides = parser.parse_known_args()
    trainers = {}
    for seq in args.seq:
        shape = [f"--train.seq_len={seq}", f"--train.batch_size={args.tokens // seq}"]
        shape.append(f"--model.max_seq_len={max(seq, 1024)}")
        for name, extra in ARMS.items():
            trainers[(name, seq)] = endless_trainer(CONFIG, [*COMMON, *extra, *shape, *overrides])
    tokens = {}
    for key, run in trainers.items():
        time_steps(run.train_step, args.warmup)
        tokens[key] = run.train_step().tokens  # every later step reads as many
    times = alternate_blocks(trainers, steps=args.steps, repeats=args.repeats)
    peaks = {key: peak_mib(run.train_step) for key, run in trainers.items()}

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, {CONFIG}")
    print(f"common: {' '.join([*COMMON, *overrides])}")
    for name, extra in ARMS.items():
        cfg = trainers[(name, args.seq[0])].cfg.model
        print(f"{name}: {' '.join(extra)}: family {cfg.family}, {count_params(cfg).total:,} params")
    print(
        "\n| seq × batch | arm | step (ms), median | min-max (ms) | tok/s | MFLOP/token "
        "| GFLOP/s | peak MiB | step / llama | FLOPs / llama |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for seq in args.seq:
        llama = statistics.median(times[("llama", seq)])
        llama_flops = flops_per_token(trainers[("llama", seq)].cfg.model, seq)
        for name in ARMS:
            key = (name, seq)
            seconds, step = times[key], statistics.median(times[key])
            flops = flops_per_token(trainers[key].cfg.model, seq)
            rate = tokens[key] / step
            ratios = f"{step / llama:.3f} | {flops / llama_flops:.3f}"
            print(
                f"| {seq} × {tokens[key] // seq} | {name} | {1e3 * step:.1f} | "
                f"{1e3 * min(seconds):.1f}-{1e3 * max(seconds):.1f} | {rate:,.0f} | "
                f"{flops / 1e6:.2f} | {rate * flops / 1e9:.1f} | {peaks[key]:.0f} | {ratios} |"
            )


if __name__ == "__main__":
    main()
