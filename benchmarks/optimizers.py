"""Optimizer step time on CPU: each optimizer against AdamW (foreach), and Muon's owner compute.

Only `optimizer.step()` is timed (every optimizer of the model part: Muon's step is Muon's and
its AdamW half's), after one forward and backward so that every parameter has a gradient; the
gradients stay as they are between steps. Every optimizer is built with
`kiln.train.optimizer.build_optimizer` on the same model (fp32 weights and gradients, as under
`train.mixed_precision = "fp32"`; Muon's Newton–Schulz dtype is set per arm). Each arm steps once
before timing (the warm-up: its state is allocated; Muon warms up with `ns_steps = 1`, the same
kernels at a fifth of the cost), then the arms are timed in turn, the order rotated from one
repeat to the next, and each arm's ratio to AdamW is taken repeat by repeat, so load that drifts
during the run hits every arm alike.

single   one process, `OMP_NUM_THREADS=2`: adamw, lion, schedule_free_adamw, muon with its
         Newton–Schulz (NS) in bf16 (the default; arm `muon`) and in fp32 (`muon_fp32`, as
         under `train.mixed_precision = "fp32"`). With --ns-shapes, also one NS of each distinct
         matrix shape in bf16 and in fp32: on CPU, bf16 matmuls are 20-50x slower than fp32, too
         slow to time Muon's bf16 step whole on the larger model, so its bf16 step is estimated
         as the fp32 step plus the bf16 - fp32 difference of its NS.
ranks    under torchrun, FSDP dp_shard = ranks, one thread per rank (gloo): adamw and Muon
         with owner_compute = true / false (`muon_owner`, `muon_every`), NS in bf16 and fp32.
         Wall and CPU time of the step on every rank (after a barrier). Then NS and its
         broadcasts alone on whole matrices (no momentum, no FSDP gathers): every rank computes
         every matrix, the owner computes each in kiln's order, the owners compute all theirs
         first. Then per matrix shape, on rank 0: one NS (bf16, fp32), and one fp32 broadcast.
         Without torchrun (one rank): the same arms in one process, one thread, the reference.
all      (default) single on the demo preset (with --ns-shapes) and on llama3_125m, Muon's bf16
         step left out (--bf16-step times it: ~1 min a step on demo, ~20 min on llama3_125m);
         then ranks at 1, 2 and 4 on the debug preset; prints the tables of
         benchmarks/optimizers.md. 1.5-2.5 minutes on 2 shared cores.

    python benchmarks/optimizers.py
    python benchmarks/optimizers.py single --model demo --repeats 3            # bf16 step too
    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        benchmarks/optimizers.py ranks --model default --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

MODELS = {
    # configs/train/demo.toml's model: dim 384, 6 layers, 6 heads, 2 KV heads, ffn 1024, vocab 4096.
    "demo": ["--model.preset=demo"],
    # ~125M: dim 768, 12 layers, 12 heads, 4 KV heads, ffn 2048, vocab 32768.
    "llama3_125m": ["--model.preset=llama3_125m"],
    # ModelConfig's defaults: dim 256, 4 layers, 8 heads, 4 KV heads, ffn 768, vocab 4096.
    "default": [],
    # Tiny (dim 128, 2 layers): a smoke test of this script.
    "debug": ["--model.preset=debug"],
}
SINGLE_ARMS = ("adamw", "lion", "schedule_free_adamw", "muon", "muon_fp32")
RANK_ARMS = ("adamw", "muon_owner", "muon_every", "muon_owner_fp32", "muon_every_fp32")
MARK = "RESULT "
# The Llama family's embeddings, final norm and head: Muon leaves them to AdamW.
IO_MODULES = ("tok_embeddings", "norm", "output")


def load() -> float:
    return os.getloadavg()[0]


# -- building --------------------------------------------------------------------------------


def build(model_name: str, parallel=None):
    """(config, model) with gradients from one forward and backward of 1 x 64 tokens."""
    import torch
    import torch.nn.functional as F

    from kiln.config import load_config
    from kiln.model import build_model, materialize
    from kiln.parallel.apply import apply_parallelism

    overrides = [*MODELS[model_name], "--train.mixed_precision=fp32"]
    if parallel is not None and parallel.world_size > 1:
        overrides.append(f"--distributed.dp_shard={parallel.world_size}")
    cfg = load_config(None, overrides)
    model = build_model(cfg.model)
    if parallel is not None and parallel.world_size > 1:
        (model,) = apply_parallelism(model, cfg, parallel)
    materialize(model, device="cpu", seed=0)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(cfg.model.vocab_size, (1, 65), generator=generator)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    return cfg, model


def arm_optimizers(model, cfg, arm: str) -> list:
    """The optimizers of one arm: `muon[_owner|_every][_fp32]`, or an optimizer's name."""
    import torch

    from kiln.train.optimizer import build_optimizer

    name = "muon" if arm.startswith("muon") else arm
    owner = True if "_owner" in arm else False if "_every" in arm else None
    ns_dtype = torch.float32 if arm.endswith("_fp32") else torch.bfloat16
    settings = dataclasses.replace(cfg.optimizer, name=name, owner_compute=owner)
    return build_optimizer(model, settings, ns_dtype=ns_dtype, io_modules=IO_MODULES)


def step(optimizers: list, *, ns_steps: int | None = None) -> None:
    """One step of every optimizer; Muon with `ns_steps` iterations if given (the warm-up)."""
    from kiln.train.muon import Muon

    groups = [g for o in optimizers if isinstance(o, Muon) for g in o.param_groups]
    kept = [g["ns_steps"] for g in groups]
    if ns_steps is not None:
        for group in groups:
            group["ns_steps"] = ns_steps
    for optimizer in optimizers:
        optimizer.step()
    for group, steps in zip(groups, kept, strict=True):
        group["ns_steps"] = steps


def timed(fn: Callable[[], object], before: Callable[[], object] = lambda: None) -> dict:
    before()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}


def rotated(arms: list[str], repeat: int) -> list[str]:
    k = repeat % len(arms)
    return arms[k:] + arms[:k]


def muon_shapes(model) -> dict[tuple[int, int], int]:
    """Each distinct (rows, cols) Muon orthogonalizes and how many matrices have it (a stack of
    experts counts each expert)."""
    from kiln.config.sections import OptimizerConfig
    from kiln.train.muon import Muon
    from kiln.train.optimizer import build_optimizer

    shapes: dict[tuple[int, int], int] = {}
    for optimizer in build_optimizer(model, OptimizerConfig(name="muon"), io_modules=IO_MODULES):
        if isinstance(optimizer, Muon):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    key = (p.shape[-2], p.shape[-1])
                    shapes[key] = shapes.get(key, 0) + (p.shape[0] if p.ndim == 3 else 1)
    return shapes


def time_newton_schulz(shape: tuple[int, int], repeats: int) -> dict[str, float]:
    """Median seconds of one Newton–Schulz (5 steps) of a (rows, cols) matrix, bf16 and fp32,
    alternated, after a warm-up of one step in each dtype."""
    import torch

    from kiln.train.muon import newton_schulz

    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    for dtype in dtypes.values():
        newton_schulz(x, steps=1, dtype=dtype)
    times: dict[str, list[float]] = {"bf16": [], "fp32": []}
    for repeat in range(repeats):
        for name in rotated(list(dtypes), repeat):
            times[name].append(
                timed(lambda d=dtypes[name]: newton_schulz(x, steps=5, dtype=d))["wall"]
            )
    return {name: statistics.median(values) for name, values in times.items()}


# -- single: one process ---------------------------------------------------------------------


def single(args: argparse.Namespace) -> dict:
    import torch

    started_load = load()
    cfg, model = build(args.model)
    arms = [a for a in SINGLE_ARMS if a not in args.skip]
    optimizers = {arm: arm_optimizers(model, cfg, arm) for arm in arms}
    for arm in arms:
        step(optimizers[arm], ns_steps=1)
    rounds = []
    for repeat in range(args.repeats):
        row = {"load": load()}
        for arm in rotated(arms, repeat):
            row[arm] = timed(lambda arm=arm: step(optimizers[arm]))
        rounds.append(row)
        print(
            f"{args.model} repeat {repeat + 1}: load {row['load']:.2f}, "
            + ", ".join(f"{a} {1e3 * row[a]['wall']:.0f} ms" for a in arms),
            file=sys.stderr,
            flush=True,
        )
    result = {
        "mode": "single",
        "model": args.model,
        "params": sum(p.numel() for p in model.parameters()),
        "threads": torch.get_num_threads(),
        "load_before": started_load,
        "rounds": rounds,
    }
    if args.ns_shapes:
        shapes = muon_shapes(model)
        result["ns_shapes"] = [
            {"shape": list(s), "count": n, **time_newton_schulz(s, args.ns_repeats)}
            for s, n in shapes.items()
        ]
    return result


# -- ranks: FSDP under torchrun --------------------------------------------------------------


def ranks(args: argparse.Namespace) -> dict | None:
    import torch
    import torch.distributed as dist

    from kiln.config import load_config
    from kiln.parallel.mesh import init_parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    started_load = load()
    layout = load_config(None, [f"--distributed.dp_shard={world}"] if world > 1 else [])
    parallel = init_parallel(layout.distributed, torch.device("cpu"))
    cfg, model = build(args.model, parallel)
    arms = [a for a in RANK_ARMS if a not in args.skip]
    if world == 1:  # one owner or every rank: the same in one process
        arms = [a for a in arms if "_every" not in a]
    barrier = dist.barrier if world > 1 else (lambda: None)
    optimizers = {arm: arm_optimizers(model, cfg, arm) for arm in arms}
    for arm in arms:
        barrier()
        step(optimizers[arm], ns_steps=1)
    rounds = []
    for repeat in range(args.repeats):
        row = {"load": load()}
        for arm in rotated(arms, repeat):
            row[arm] = timed(lambda arm=arm: step(optimizers[arm]), before=barrier)
        rounds.append(row)
        if parallel.is_main:
            print(
                f"{world} ranks repeat {repeat + 1}: load {row['load']:.2f}, "
                + ", ".join(f"{a} {1e3 * row[a]['wall']:.0f} ms" for a in arms),
                file=sys.stderr,
                flush=True,
            )
    ns_rounds = newton_schulz_only(model, args.repeats, world, barrier) if world > 1 else []
    shapes = shape_costs(model, args.ns_repeats, parallel.is_main, world, barrier)
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, rounds)
        ns_gathered = [None] * world
        dist.all_gather_object(ns_gathered, ns_rounds)
        dist.destroy_process_group()
    else:
        gathered, ns_gathered = [rounds], [ns_rounds]
    if not parallel.is_main:
        return None
    return {
        "mode": "ranks",
        "model": args.model,
        "params": sum(p.numel() for p in model.parameters()),
        "world": world,
        "load_before": started_load,
        "rounds_per_rank": gathered,
        "ns_rounds_per_rank": ns_gathered,
        "shapes": shapes,
    }


NS_ARMS = ("every", "owner", "owner_first")


def newton_schulz_only(model, repeats: int, world: int, barrier) -> list[dict]:
    """Newton–Schulz and its broadcasts alone, on whole random matrices of the shapes Muon takes
    (in its order), without the momentum and FSDP's gathers: every rank computes every matrix
    (`every`); matrix i's owner (i mod ranks, as kiln picks it) computes it and broadcasts it
    before matrix i + 1 is started (`owner`, kiln's order: the others wait in the broadcast, one
    rank computes at a time); every owner first computes all its matrices, then the broadcasts
    (`owner_first`: the owners compute at the same time). bf16 and fp32."""
    import torch
    import torch.distributed as dist

    from kiln.config.sections import OptimizerConfig
    from kiln.train.muon import Muon, newton_schulz
    from kiln.train.optimizer import build_optimizer

    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(0)
    matrices = [
        torch.randn(p.shape, generator=generator)
        for optimizer in build_optimizer(model, OptimizerConfig(name="muon"), io_modules=IO_MODULES)
        if isinstance(optimizer, Muon)
        for group in optimizer.param_groups
        for p in group["params"]
    ]

    def orthogonalized(i: int, dtype) -> torch.Tensor:
        if i % world == rank:
            return newton_schulz(matrices[i], steps=5, dtype=dtype).contiguous()
        return torch.empty_like(matrices[i])

    def run(arm: str, dtype) -> None:
        if arm == "every":
            for x in matrices:
                newton_schulz(x, steps=5, dtype=dtype)
        elif arm == "owner":
            for i in range(len(matrices)):
                dist.broadcast(orthogonalized(i, dtype), src=i % world)
        else:
            results = [orthogonalized(i, dtype) for i in range(len(matrices))]
            for i, result in enumerate(results):
                dist.broadcast(result, src=i % world)

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    arms = [(arm, name) for name in dtypes for arm in NS_ARMS]
    rounds = []
    for repeat in range(repeats + 1):  # the first round is the warm-up
        row = {}
        for arm, name in rotated(arms, repeat):
            row[f"{arm}_{name}"] = timed(lambda a=arm, n=name: run(a, dtypes[n]), before=barrier)
        if repeat:
            rounds.append(row)
    return rounds


def shape_costs(model, repeats: int, main: bool, world: int, barrier) -> list[dict]:
    """Per distinct Muon matrix shape: one Newton–Schulz on rank 0 alone (the others wait), and
    one fp32 broadcast of that shape from rank 0 (the slowest rank's time)."""
    import torch
    import torch.distributed as dist

    costs = []
    for shape, count in muon_shapes(model).items():
        entry = {"shape": list(shape), "count": count}
        barrier()
        if main:
            entry |= time_newton_schulz(shape, repeats)
        if world > 1:
            buffer = torch.zeros(shape)
            seconds = []
            for _ in range(6):  # cheap: 5 timed after one warm-up
                send = lambda b=buffer: dist.broadcast(b, src=0)  # noqa: E731
                seconds.append(timed(send, before=barrier)["wall"])
            slowest = [None] * world
            dist.all_gather_object(slowest, statistics.median(seconds[1:]))
            entry["broadcast"] = max(slowest)
        costs.append(entry)
    return costs


# -- all: run everything, print the tables ---------------------------------------------------


def launch(command: list[str], threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(command)}\n{done.stdout[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    return json.loads(lines[-1][len(MARK) :])


def run_all(args: argparse.Namespace) -> None:
    script = os.path.abspath(__file__)
    results = []
    for model in args.models:
        command = [sys.executable, script, "single", "--model", model]
        command += ["--repeats", str(args.repeats if model != "llama3_125m" else args.big_repeats)]
        if not args.bf16_step:
            command += ["--skip", "muon"]
        if model in args.ns_shapes_of:
            command += ["--ns-shapes", "--ns-repeats", str(args.ns_repeats)]
        print(f"single {model}: load {load():.2f} before", flush=True)
        results.append(launch(command, 2))
    for world in args.ranks:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
        command = [sys.executable, *(launcher if world > 1 else []), script, "ranks"]
        command += ["--model", args.dist_model, "--repeats", str(args.dist_repeats)]
        command += ["--ns-repeats", str(args.ns_repeats)]
        print(f"ranks {world} ({args.dist_model}): load {load():.2f} before", flush=True)
        results.append(launch(command, 1))
    print()
    for result in results:
        print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _ms(seconds: list[float]) -> str:
    return f"{1e3 * statistics.median(seconds):,.0f}"


def _ratio(values: list[float]) -> str:
    middle = statistics.median(values)
    return (
        f"{middle:.2f} ({min(values):.2f}-{max(values):.2f})"
        if len(values) > 1
        else f"{middle:.2f}"
    )


def report(result: dict) -> str:
    if result["mode"] == "single":
        return _report_single(result)
    return _report_ranks(result)


def _report_single(result: dict) -> str:
    rounds = result["rounds"]
    arms = [a for a in SINGLE_ARMS if a in rounds[0]]
    loads = ", ".join(f"{r['load']:.1f}" for r in rounds)
    lines = [
        f"### {result['model']} ({result['params'] / 1e6:.1f}M parameters), one process, "
        f"{result['threads']} threads; {len(rounds)} repeats; load {result['load_before']:.2f} "
        f"before, {loads} at each repeat",
        "",
        "| optimizer | median step (ms) | / AdamW, median (min-max) | CPU s / wall s |",
        "|---|---|---|---|",
    ]
    for arm in arms:
        ratios = [r[arm]["wall"] / r["adamw"]["wall"] for r in rounds]
        cpu = statistics.median(r[arm]["cpu"] / r[arm]["wall"] for r in rounds)
        label = {"muon": "muon (NS bf16)", "muon_fp32": "muon (NS fp32)"}.get(arm, arm)
        lines.append(
            f"| {label} | {_ms([r[arm]['wall'] for r in rounds])} | {_ratio(ratios)} | {cpu:.2f} |"
        )
    if "ns_shapes" in result:
        lines += [
            "",
            "Newton–Schulz (5 steps) per matrix shape, median ms:",
            "",
            "| shape | matrices | bf16 | fp32 | bf16/fp32 |",
            "|---|---|---|---|---|",
        ]
        bf16 = fp32 = 0.0
        for entry in result["ns_shapes"]:
            bf16 += entry["count"] * entry["bf16"]
            fp32 += entry["count"] * entry["fp32"]
            lines.append(
                f"| {entry['shape'][0]} x {entry['shape'][1]} | {entry['count']} | "
                f"{1e3 * entry['bf16']:,.0f} | {1e3 * entry['fp32']:,.0f} | "
                f"{entry['bf16'] / entry['fp32']:.2f} |"
            )
        lines.append(
            f"| all of them | {sum(e['count'] for e in result['ns_shapes'])} | "
            f"{1e3 * bf16:,.0f} | {1e3 * fp32:,.0f} | {bf16 / fp32:.2f} |"
        )
        if "muon_fp32" in rounds[0]:
            # Muon's step in bf16, not timed: the fp32 step with each NS's fp32 time replaced by
            # its bf16 time.
            estimate = [r["muon_fp32"]["wall"] + bf16 - fp32 for r in rounds]
            ratios = [e / r["adamw"]["wall"] for e, r in zip(estimate, rounds, strict=True)]
            lines.append(
                f"\nEstimated muon (NS bf16) step: {_ms(estimate)} ms, {_ratio(ratios)} x AdamW "
                f"(the fp32 step plus the bf16 - fp32 difference of its Newton–Schulz)."
            )
    return "\n".join(lines) + "\n"


def _report_ranks(result: dict) -> str:
    per_rank = result["rounds_per_rank"]
    world, rounds = result["world"], per_rank[0]
    arms = [a for a in RANK_ARMS if a in rounds[0]]
    loads = ", ".join(f"{r['load']:.1f}" for r in rounds)
    title = "one process, 1 thread" if world == 1 else f"dp_shard={world}, 1 thread per rank"
    lines = [
        f"### Muon at {world} rank{'s' if world > 1 else ''}: {result['model']} "
        f"({result['params'] / 1e6:.1f}M parameters), "
        f"{title}; {len(rounds)} repeats; load {result['load_before']:.2f} before, {loads} at "
        f"each repeat",
        "",
        "| arm | rank 0 (ms) | max over ranks (ms) | / AdamW (max over ranks) | "
        "CPU ms per rank (min-max) |",
        "|---|---|---|---|---|",
    ]
    for arm in arms:
        slowest = [max(r[i][arm]["wall"] for r in per_rank) for i in range(len(rounds))]
        adamw = [max(r[i]["adamw"]["wall"] for r in per_rank) for i in range(len(rounds))]
        cpu = [statistics.median(x[arm]["cpu"] for x in r) for r in per_rank]
        lines.append(
            f"| {arm} | {_ms([r[arm]['wall'] for r in rounds])} | {_ms(slowest)} | "
            f"{_ratio([s / a for s, a in zip(slowest, adamw, strict=True)])} | "
            f"{1e3 * min(cpu):,.0f}-{1e3 * max(cpu):,.0f} |"
        )
    if "muon_every" in rounds[0]:
        for dtype, suffix in (("bf16", ""), ("fp32", "_fp32")):
            owner, every = f"muon_owner{suffix}", f"muon_every{suffix}"
            if owner in rounds[0] and every in rounds[0]:
                ratios = [
                    max(r[i][owner]["wall"] for r in per_rank)
                    / max(r[i][every]["wall"] for r in per_rank)
                    for i in range(len(rounds))
                ]
                lines.append(f"\nowner / every rank, NS {dtype}: {_ratio(ratios)}")
    ns_rounds = result.get("ns_rounds_per_rank", [[]])
    if ns_rounds and ns_rounds[0]:
        lines += [
            "",
            "Newton–Schulz and broadcasts alone (whole matrices, no momentum, no FSDP gathers):",
            "",
            "| NS dtype | every rank (ms) | owner, kiln's order (ms) | owners compute first (ms) | "
            "owner / every | owner first / every | CPU ms (median rank): every, owner, first |",
            "|---|---|---|---|---|---|---|",
        ]
        for dtype in ("bf16", "fp32"):
            slowest = {
                arm: [
                    max(r[i][f"{arm}_{dtype}"]["wall"] for r in ns_rounds)
                    for i in range(len(ns_rounds[0]))
                ]
                for arm in NS_ARMS
            }
            cpu = {
                arm: statistics.median(
                    statistics.median(x[f"{arm}_{dtype}"]["cpu"] for x in r) for r in ns_rounds
                )
                for arm in NS_ARMS
            }
            ratio = {
                arm: _ratio([a / e for a, e in zip(slowest[arm], slowest["every"], strict=True)])
                for arm in NS_ARMS
            }
            lines.append(
                f"| {dtype} | {_ms(slowest['every'])} | {_ms(slowest['owner'])} | "
                f"{_ms(slowest['owner_first'])} | {ratio['owner']} | {ratio['owner_first']} | "
                + ", ".join(f"{1e3 * cpu[a]:,.0f}" for a in NS_ARMS)
                + " |"
            )
    lines += [
        "",
        "| shape | matrices | NS bf16 (ms) | NS fp32 (ms) | fp32 broadcast (ms) |",
        "|---|---|---|---|---|",
    ]
    for entry in result["shapes"]:
        broadcast = f"{1e3 * entry['broadcast']:.2f}" if "broadcast" in entry else "-"
        lines.append(
            f"| {entry['shape'][0]} x {entry['shape'][1]} | {entry['count']} | "
            f"{1e3 * entry['bf16']:.1f} | {1e3 * entry['fp32']:.1f} | {broadcast} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", nargs="?", choices=("all", "single", "ranks"), default="all")
    parser.add_argument("--model", choices=sorted(MODELS), default="demo")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip", nargs="*", default=[], help="arms left out")
    parser.add_argument("--ns-shapes", action="store_true", help="single: NS per matrix shape")
    parser.add_argument("--ns-repeats", type=int, default=3)
    # all
    parser.add_argument("--models", nargs="*", default=["demo", "llama3_125m"])
    parser.add_argument("--big-repeats", type=int, default=2, help="repeats on llama3_125m")
    parser.add_argument(
        "--bf16-step",
        action="store_true",
        help="time Muon's whole step with NS in bf16 too (CPU: ~1 min a step on demo, ~20 on "
        "llama3_125m); without it, its NS per shape gives an estimate (--ns-shapes-of)",
    )
    parser.add_argument("--ns-shapes-of", nargs="*", default=["demo"], help="models: NS per shape")
    parser.add_argument("--ranks", nargs="*", type=int, default=[1, 2, 4])
    parser.add_argument("--dist-model", choices=sorted(MODELS), default="debug")
    parser.add_argument("--dist-repeats", type=int, default=5)
    parser.add_argument("--json", help="all: also write every result here")
    args = parser.parse_args()
    if args.mode == "all":
        run_all(args)
        return
    result = single(args) if args.mode == "single" else ranks(args)
    if result is not None:
        print(MARK + json.dumps(result), flush=True)
        print(report(result), file=sys.stderr)


if __name__ == "__main__":
    main()
