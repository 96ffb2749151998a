"""FP8 training numerics against bf16, loss curves of the debug model, and (on a GPU) speed.

--device cpu (default; torchao emulates the float8 matmuls: numerics, not speed): 1. SQNR (dB,
torchao's `compute_error`) of the output and every weight gradient of kiln's Attention,
FeedForward and the debug model (logits), float8 against the same module and inputs in bf16,
mean and min over seeds; 2. `kiln train` on the demo corpus in fp32, bf16, fp8 tensorwise and
rowwise (same seed and data): losses, the largest gap to bf16 and fp32, median tok/s vs fp32.

--device cuda: llama3_1b block stack, bf16 vs fp8, compiled: tokens/s and peak memory.

    python benchmarks/fp8.py [--seeds 3] [--steps 30]
    python benchmarks/fp8.py --device cuda [--batch 4 --seq 2048 --iters 10]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from kiln.config import JobConfig, ModelConfig
from kiln.config.sections import Float8Config, TrainConfig
from kiln.model import build_model, materialize
from kiln.model.feed_forward import FeedForward
from kiln.model.llama.attention import Attention
from kiln.model.llama.model import Block
from kiln.model.llama.plan import llama_plan
from kiln.model.rope import rope_tables
from kiln.parallel.float8 import convert_to_float8

REPO = Path(__file__).resolve().parent.parent
RECIPES = ("tensorwise", "rowwise")
# The layer tests' shape (tests/unit/test_float8.py): dims multiples of 16, as float8 needs.
LAYER = ModelConfig(
    dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=384, max_seq_len=64
)
BATCH, SEQ = 4, 64


def preset(name: str) -> ModelConfig:
    return ModelConfig(**tomllib.loads((REPO / "configs" / "model" / f"{name}.toml").read_text()))


def fp8_job(recipe: str) -> JobConfig:
    return JobConfig(train=TrainConfig(mixed_precision="fp8"), fp8=Float8Config(recipe=recipe))


def layer_case(name: str, seed: int) -> tuple[nn.Module, Callable, torch.Tensor]:
    """(bf16 module, forward(module, x), input) for one layer type or the whole debug model."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "model":
        cfg = preset("debug")
        model = materialize(build_model(cfg), device="cpu", seed=seed).bfloat16()
        return model, lambda m, x: m(x), torch.randint(cfg.vocab_size, (BATCH, SEQ), generator=gen)
    x = torch.randn(BATCH, SEQ, LAYER.dim, generator=gen).bfloat16()
    if name == "attention":
        cos, sin = rope_tables(LAYER.resolved_head_dim, SEQ, 10000.0, "cpu")
        return Attention(LAYER).bfloat16(), lambda m, x: m(x, cos, sin), x
    return FeedForward(LAYER.dim, LAYER.ffn_hidden_dim).bfloat16(), lambda m, x: m(x), x


def sqnr_once(name: str, recipe: str, seed: int) -> dict[str, float]:
    """SQNR of the output and of each 2-D weight's gradient (model: grouped over the layers,
    min across them), float8 against bf16 on the same weights, input and output gradient."""
    from torchao.float8.float8_utils import compute_error

    reference, forward, x = layer_case(name, seed)
    fp8 = copy.deepcopy(reference)
    # The model keeps its head in bf16 (Llama's plan), as training does.
    excluded = llama_plan(preset("debug")).float8_excluded if name == "model" else ()
    convert_to_float8(fp8, fp8_job(recipe), device=torch.device("cpu"), tp=1, excluded=excluded)
    out = {}
    for key, module in (("bf16", reference), ("fp8", fp8)):
        out[key] = forward(module, x)
        grad_out = torch.randn(out[key].shape, generator=torch.Generator().manual_seed(seed + 1))
        out[key].backward(grad_out.bfloat16())
    # The model's own head is a weight named "output": its output is "logits".
    key = "logits" if name == "model" else "output"
    result = {key: compute_error(out["bf16"].float(), out["fp8"].float()).item()}
    grads = dict(fp8.named_parameters())
    for pname, param in reference.named_parameters():
        if param.ndim != 2:  # norms' gains: not what float8 touches directly
            continue
        key = ".".join(p for p in pname.split(".")[:-1] if not p.isdigit() and p != "layers")
        db = compute_error(param.grad.float(), grads[pname].grad.float()).item()
        result[key] = min(db, result.get(key, float("inf")))
    return result


def sqnr_table(seeds: int) -> None:
    print(f"\n## SQNR against bf16 (dB), mean / min over {seeds} seeds\n")
    print("| module | tensor | tensorwise mean | tensorwise min | rowwise mean | rowwise min |")
    print("|---|---|---:|---:|---:|---:|")
    for name in ("attention", "feed_forward", "model"):
        runs = {r: [sqnr_once(name, r, s) for s in range(seeds)] for r in RECIPES}
        for tensor in runs[RECIPES[0]][0]:
            cells = []
            for r in RECIPES:
                values = [run[tensor] for run in runs[r]]
                cells += [f"{statistics.mean(values):.1f}", f"{min(values):.1f}"]
            print(f"| {name} | {tensor} | " + " | ".join(cells) + " |", flush=True)


MP = "--train.mixed_precision="
RUNS = {"fp32": [MP + "fp32"], "bf16": [MP + "bf16"]}
RUNS |= {f"fp8 {r}": [MP + "fp8", f"--fp8.recipe={r}"] for r in RECIPES}


def train_run(label: str, flags: list[str], steps: int, workdir: Path) -> list[dict]:
    run_dir = workdir / label.replace(" ", "_")
    cmd = [
        sys.executable, "-m", "kiln", "train", "configs/train/debug.toml",
        f"--data.path={workdir / 'demo'}", f"--train.max_steps={steps}", "--train.seq_len=64",
        "--train.batch_size=8", "--data.num_workers=0", "--metrics.log_interval=1",
        "--checkpoint.interval=0", "--checkpoint.save_final=false", "--metrics.plot=false",
        f"--metrics.run_dir={run_dir}", *flags,
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def loss_table(steps: int, workdir: Path) -> None:
    from kiln.data.demo_corpus import ensure_demo_corpus

    ensure_demo_corpus(workdir / "demo", max_bytes=2_000_000)
    records = {label: train_run(label, flags, steps, workdir) for label, flags in RUNS.items()}
    loss = {label: [r["loss"] for r in recs] for label, recs in records.items()}
    # Step 1 includes start-up; the median of the rest is the steady rate.
    tok_s = {k: statistics.median(r["tokens_per_sec"] for r in v[1:]) for k, v in records.items()}
    shown = [s for s in (1, 10, 20, 30) if s <= steps]
    print(f"\n## Debug model, demo corpus, {steps} steps (batch 8 × 64 tokens)\n")
    head = " | ".join(f"loss @{s}" for s in shown)
    print(f"| run | {head} | max abs Δ vs bf16 | max abs Δ vs fp32 | tok/s | vs fp32 |")
    print("|---|" + "---:|" * (len(shown) + 4))
    for label, values in loss.items():
        gaps = [
            max(abs(a - b) for a, b in zip(values, loss[ref], strict=True))
            for ref in ("bf16", "fp32")
        ]
        cells = [f"{values[s - 1]:.4f}" for s in shown] + [f"{g:.4f}" for g in gaps]
        cells += [f"{tok_s[label]:,.0f}", f"{tok_s[label] / tok_s['fp32']:.2f}×"]
        print(f"| {label} | " + " | ".join(cells) + " |")


class BlockStack(nn.Module):
    """The model's blocks alone: the embedding and the head (kept in bf16 under fp8) would
    only dilute the comparison."""

    def __init__(self, cfg: ModelConfig, seq: int, device: torch.device):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        cos, sin = rope_tables(cfg.resolved_head_dim, seq, cfg.rope_theta, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return x


def time_stack(
    cfg: ModelConfig, recipe: str | None, args: argparse.Namespace
) -> tuple[float, float]:
    """(tokens/s, peak GiB) of forward+backward of the block stack; recipe None: bf16."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    with device:
        stack = BlockStack(cfg, args.seq, device)
    for p in stack.parameters():
        if p.ndim == 2:  # Normal weights so that float8's dynamic scales see realistic ranges.
            nn.init.normal_(p, std=cfg.init_std)
    stack = stack.bfloat16()
    if recipe is not None:
        convert_to_float8(stack, fp8_job(recipe), device=device, tp=1)
    step_fn = torch.compile(stack) if args.compile else stack
    x = torch.randn(args.batch, args.seq, cfg.dim, device=device, dtype=torch.bfloat16)
    grad = torch.randn_like(x)

    def step() -> None:
        step_fn(x).backward(grad)
        stack.zero_grad(set_to_none=True)

    for _ in range(args.warmup):  # compilation and autotuning happen here
        step()
    on_gpu = device.type == "cuda"  # (cpu: a smoke test of this path, no numbers to keep)
    if on_gpu:  # the peak of the timed steps, not of compilation
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.iters):
        step()
    if on_gpu:
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / args.iters
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else 0.0
    return args.batch * args.seq / seconds, peak


def speed_table(args: argparse.Namespace) -> None:
    cfg = preset(args.preset)
    print(f"\n## {args.preset} block stack ({cfg.n_layers} layers, dim {cfg.dim}), "
          f"batch {args.batch} × {args.seq}, forward+backward, compile={args.compile}\n")  # fmt: skip
    print("| precision | tokens/s | vs bf16 | peak memory (GiB) |")
    print("|---|---:|---:|---:|")
    base = None
    for recipe in (None, *RECIPES):
        tok_s, peak = time_stack(cfg, recipe, args)
        base = base or tok_s
        label = "bf16" if recipe is None else f"fp8 {recipe}"
        print(f"| {label} | {tok_s:,.0f} | {tok_s / base:.2f}× | {peak:.2f} |", flush=True)
        torch._dynamo.reset()  # each variant compiles afresh, not on the last one's guards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--preset", default="llama3_1b", help="--device cuda: model shape")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3, help="--device cuda: untimed steps")
    parser.add_argument("--iters", type=int, default=10, help="--device cuda: timed steps")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, device {args.device}")
    if args.device == "cuda":
        speed_table(args)
        return
    sqnr_table(args.seeds)
    with tempfile.TemporaryDirectory() as workdir:
        loss_table(args.steps, Path(workdir))


if __name__ == "__main__":
    main()
