"""The worker processes of benchmarks/gpu_side_by_side.py: the GEMM timings and device facts,
and the hand-written training loop. Each runs in a process of its own, so no run inherits
another's GPU memory or compiled graphs.

    python benchmarks/side_by_side_workers.py gemm --device cuda --shapes S.json --result R.json
    python benchmarks/side_by_side_workers.py hand --model llama3_1b --mode "bf16 compiled" ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from gpu_side_by_side import MODELS, MODES, Variant, job_config

# ---- GEMM timings --------------------------------------------------------------------------


def time_gemms(shapes: list[list], device: str, reps: int = 10) -> list[float]:
    """Seconds per product of each [M, K, N, kind] (kind "bf16": torch.mm, "fp8": tensorwise
    torch._scaled_mm, e4m3 operands, bf16 out), on random data."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for m, k, n, kind in shapes:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        if kind == "fp8":
            one = torch.ones((), device=device)
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major

            def product(a8=a8, b8=b8, one=one):
                return torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        else:

            def product(a=a, b=b):
                return torch.mm(a, b.t())  # the layout nn.Linear's forward multiplies in

        for _ in range(3):
            product()
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            product()
        sync()
        times.append((time.perf_counter() - start) / reps)
    return times


def device_info(device: str) -> dict:
    import torch

    from kiln.metrics.mfu import peak_flops

    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import torchao

        info["torchao"] = torchao.__version__
    except ImportError as error:
        info["torchao"] = f"not importable ({error})"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info |= {"name": props.name, "memory_bytes": props.total_memory}
        info["peak_bf16_flops"] = peak_flops(torch.device("cuda"))
    else:
        names = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln]
        info |= {"name": names[0].split(":", 1)[1].strip() if names else "cpu"}
        info |= {"memory_bytes": None, "peak_bf16_flops": None}
    return info


def gemm_worker(args: argparse.Namespace) -> None:
    """Device facts and the times of the GEMM shapes in --shapes (a JSON file) into --result."""
    shapes = json.loads(Path(args.shapes).read_text())
    result = {"device": device_info(args.device), "times": time_gemms(shapes, args.device)}
    Path(args.result).write_text(json.dumps(result))


# ---- the hand-written loop -----------------------------------------------------------------


def read_batches(cfg, steps: int) -> list[tuple]:
    """`steps` (inputs, labels) batches of the run's data, in kiln's order, read up front."""
    from kiln.data.loader import BatchLoader
    from kiln.data.sources import open_data

    sources, _ = open_data(cfg, cache_dir=Path(tempfile.mkdtemp(prefix="sbs-data-")))
    loader = BatchLoader(
        sources, cfg.data, seed=cfg.train.seed, batch_size=cfg.train.batch_size, grad_accum_steps=1
    )
    return [loader.next_step().micro_batches[0] for _ in range(steps)]


def hand_model(cfg, device):
    """kiln's Transformer as kiln builds it in one process: FP8 swap, per-block compile."""

    from kiln.model import build_model, materialize

    model = build_model(cfg.model)
    if cfg.train.mixed_precision == "fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(cfg.fp8.recipe)
        # On a CPU torchao emulates the float8 matmuls, as kiln does (kiln/parallel/float8.py).
        config = dataclasses.replace(config, emulate=device.type != "cuda")
        convert_to_float8_training(
            model,
            config=config,
            module_filter_fn=lambda mod, name: (
                name != "output" and mod.in_features % 16 == 0 and mod.out_features % 16 == 0
            ),
        )
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()
    return materialize(model, device=device, seed=cfg.train.seed)


def hand_worker(args: argparse.Namespace) -> None:
    """Train with the plain loop; write per-window records like metrics.jsonl's to --result."""
    import torch

    cfg = job_config(Variant(args.model, args.mode, args.batch, args.seq, args.layers), args)
    device = torch.device(args.device)
    batches = read_batches(cfg, args.steps)
    model = hand_model(cfg, device)
    cuda = device.type == "cuda"
    if cuda:
        batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optimizer.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups, lr=cfg.optimizer.lr, betas=tuple(cfg.optimizer.betas), eps=cfg.optimizer.eps,
        fused=cuda, foreach=not cuda,
    )  # fmt: skip
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step(x, y):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast:
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip_norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    records, tokens = [], batches[0][0].numel()
    start = time.perf_counter()
    for index, (x, y) in enumerate(batches, start=1):
        loss = step(x, y)
        if args.read_every_step:  # kiln's one wait a step: is the loss finite?
            bool(torch.isfinite(loss))
        if index % args.log_every == 0 or index == 1:
            value = loss.item()  # a loop prints its loss now and then, as kiln logs it
            now = time.perf_counter()
            rate = tokens * (index - (records[-1]["step"] if records else 0)) / (now - start)
            records.append({"step": index, "tokens_per_sec": rate, "loss": value})
            start = now
    sync()
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    Path(args.result).write_text(json.dumps({"records": records, "peak_mem_gb": peak}))


def run_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of one training run (the hand loop's, and torchtitan_launcher.py's)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", choices=list(MODELS), required=True)
    p.add_argument("--mode", choices=list(MODES), required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--log-every", type=int, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--data", default="data/demo")
    p.add_argument("--result", required=True, help="JSON: logged records and peak memory")
    p.add_argument("--read-every-step", action="store_true", help="hand loop: one read a step")
    return p


def main() -> None:
    import sys

    if sys.argv[1:2] == ["gemm"]:
        p = argparse.ArgumentParser(description="time GEMM shapes")
        p.add_argument("--device", default="cuda")
        p.add_argument("--shapes", required=True, help="JSON list of [M, K, N, kind]")
        p.add_argument("--result", required=True)
        return gemm_worker(p.parse_args(sys.argv[2:]))
    if sys.argv[1:2] == ["hand"]:
        return hand_worker(run_parser("the hand-written loop").parse_args(sys.argv[2:]))
    sys.exit("usage: side_by_side_workers.py gemm|hand ...")


if __name__ == "__main__":
    main()
