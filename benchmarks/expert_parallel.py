"""Expert parallel on CPU (gloo): step time at ep = 1, 2, 4 on the same global batch, the bytes
the all-to-alls move against the count computed from the routing, and the memory per rank.

**Step time.** `kiln train` on the debug_moe recipe with the experts made to dominate (16 experts
of hidden 256, dim 256: the routed experts are 3.1M of the 6.1M parameters), seq_len 256, global
batch 8 (2048 tokens), fp32, AdamW foreach. The arms, on the same two cores, the same global
batch in each:

  ep=1: one process, OMP_NUM_THREADS=2, batch_size=8;
  ep=2: torchrun, 2 ranks x 1 thread, batch_size=4 per rank;
  ep=4: torchrun, 4 ranks x 1 thread, batch_size=2 per rank (4 threads on 2 cores);
  dp_shard=2, dp_shard=4: as ep=2 and ep=4 but FSDP alone (every rank runs all experts, whose
  weights are all-gathered like the others): the reference at the same rank count.

The arms alternate, the order rotating each round (a b c d e, b c d e a, ...); a run's throughput
is the harmonic mean of `tokens_per_sec` of the steps after --skip (tokens of all ranks; every
step holds the same tokens), the ratio to ep=1 is taken round by round against that round's ep=1
run, and the figure is the median round. The 1-minute load average is printed before every run.

**Bytes.** Every step record of every ep > 1 run (and of short runs at ep=2 and ep=4 with full
activation checkpointing, at ep=2 with two micro-batches, and at ep=2 without either, the
control that full AC's routing and losses are compared with step by step) is checked: each
rank's `ep/sent_bytes` and `ep/received_bytes` against
    passes x (routed sent + routed received token copies) x dim x 4 bytes (fp32 rows),
passes = 2 (dispatch forward sends the sent copies, combine forward sends back the received
ones, and the backward repeats both the other way) or 3 under full AC (the recompute runs both
forward exchanges again); the routed copies are the step's `ep/sent_tokens` and
`ep/received_tokens` (counted once per training forward, not again in the recompute, since
3fb189b; the AC run's counts are also compared with the control's, step by step).
Independently, each MoE layer's `moe/load/<layer>` (the fraction of the step's assignments,
all ranks, each expert received) gives the assignments landing on rank r's experts, which must
equal rank r's own assignments - what it sent + what it received, summed over the MoE layers.

**Memory** (unless --no-memory): a bigger expert model (dim 512, 3 blocks, 2 MoE layers of 16 experts of
hidden 1024: experts are 50.3M of 60.6M parameters), built by the same Trainer `kiln train` uses, at
ep=1, ep=2, ep=4, ep=2 x dp_shard=2 and dp_shard=4 (FSDP alone, for reference), 2 x 256 tokens
per rank (the per-rank batch fixed, so activations weigh alike), 3 steps; per rank: the local
bytes of the routed experts' weights and of everything else, of the AdamW state, the RSS before
the Trainer is built, with it built, and the peak RSS (ru_maxrss) after the steps.

    python benchmarks/expert_parallel.py                  # timing, bytes and memory (~6 min)
    python benchmarks/expert_parallel.py --rounds 3 --steps 14 --skip 4 --no-memory
    python benchmarks/expert_parallel.py --memory-only
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "configs/train/debug_moe.toml"
TIMING_MODEL = ["--model.moe.num_experts=16", "--model.moe.ffn_hidden_dim=256", "--model.dim=256"]
MEMORY_MODEL = [
    "--model.moe.num_experts=16",
    "--model.moe.ffn_hidden_dim=1024",
    "--model.dim=512",
    "--model.n_layers=3",
]
COMMON = [
    "--train.seq_len=256",
    "--train.mixed_precision=fp32",
    "--data.num_workers=0",
    "--checkpoint.interval=0",
    "--checkpoint.save_final=false",
    "--metrics.plot=false",
    "--metrics.log_interval=1",
]
GLOBAL_BATCH = 8
# Arms of the step-time comparison: ranks, [distributed] overrides. dp_shard=2/4 (FSDP alone, the
# experts all-gathered like every other weight) are references at the same rank counts.
ARMS = {
    "ep=1": (1, []),
    "ep=2": (2, ["--distributed.ep=2"]),
    "ep=4": (4, ["--distributed.ep=4"]),
    "dp_shard=2": (2, ["--distributed.dp_shard=2"]),
    "dp_shard=4": (4, ["--distributed.dp_shard=4"]),
}
# (label, ranks, [distributed] overrides) of the memory runs.
MEMORY_LAYOUTS = [
    ("ep=1 (1 process)", 1, []),
    ("ep=2", 2, ["--distributed.ep=2"]),
    ("ep=4", 4, ["--distributed.ep=4"]),
    ("ep=2 x dp_shard=2", 4, ["--distributed.ep=2", "--distributed.dp_shard=2"]),
    ("dp_shard=4 (FSDP only)", 4, ["--distributed.dp_shard=4"]),
]
MEMORY_BATCH_PER_RANK = 2


def loads() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def launch(ranks: int, args: list[str], tag: str) -> tuple[subprocess.CompletedProcess, float]:
    """`python [-m torch.distributed.run ...] args`, one thread per rank (two for one process);
    the run and the CPU seconds (user + system) of all its processes."""
    launcher = (
        []
        if ranks == 1
        else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    )
    threads = "2" if ranks == 1 else "1"
    # This checkout's kiln, also when run from a copy of it (git archive).
    env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": str(ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [sys.executable, *launcher, *args], env=env, cwd=ROOT, capture_output=True, text=True
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"{tag} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return done, cpu


def train_run(
    ranks: int, layout: list[str], *, steps: int, extra: list[str] = (), accum: int = 1
) -> tuple[list[dict], float]:
    """One `kiln train` run on `ranks` data ranks on the global batch: its step records and CPU
    seconds."""
    batch = GLOBAL_BATCH // ranks // accum
    with tempfile.TemporaryDirectory(prefix="kiln-ep-bench-") as tmp:
        args = [
            "-m",
            "kiln",
            "train",
            RECIPE,
            *TIMING_MODEL,
            *COMMON,
            f"--train.batch_size={batch}",
            f"--train.grad_accum_steps={accum}",
            f"--train.max_steps={steps}",
            f"--metrics.run_dir={tmp}/run",
            *layout,
            *extra,
        ]
        _, cpu = launch(ranks, args, " ".join([*layout, *extra]) or "one process")
        lines = (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], cpu


def steady_tok_s(records: list[dict], skip: int) -> float:
    rates = [r["tokens_per_sec"] for r in records if r["step"] > skip]
    return len(rates) / sum(1 / x for x in rates)


def model_shape() -> tuple[int, int, int]:
    from kiln.config import load_config

    cfg = load_config(RECIPE, [*TIMING_MODEL, *COMMON]).model
    return cfg.dim, cfg.moe.num_experts, cfg.moe.top_k


def check_bytes(records: list[dict], *, ep: int, accum: int, full_ac: bool) -> dict:
    """Every step record of one run against the expected bytes and the loads identity."""
    dim, experts, top_k = model_shape()
    seq = 256
    passes = 3 if full_ac else 2
    total = GLOBAL_BATCH * seq * top_k  # a layer's assignments on all ranks, per step
    own = total // ep  # ... of one rank
    per_rank = experts // ep
    out = {"steps": 0, "bytes_mismatch": [], "loads_mismatch": [], "loads_dev": 0.0}
    fractions, bytes_per_step = [], []
    for r in records:
        layers = [v for k, v in r.items() if k.startswith("moe/load/")]
        sent, received = r["ep/sent_tokens"], r["ep/received_tokens"]
        expected = [passes * (s + v) * dim * 4 for s, v in zip(sent, received, strict=True)]
        if expected != r["ep/sent_bytes"] or expected != r["ep/received_bytes"]:
            out["bytes_mismatch"].append((r["step"], expected, r["ep/sent_bytes"]))
        for rank in range(ep):
            on_rank = sum(
                sum(load[rank * per_rank : (rank + 1) * per_rank]) * total for load in layers
            )
            identity = len(layers) * own - sent[rank] + received[rank]
            out["loads_dev"] = max(out["loads_dev"], abs(on_rank - identity))
            if round(on_rank) != identity:
                out["loads_mismatch"].append((r["step"], rank, on_rank, identity))
        fractions.append(sum(sent) / (len(layers) * total))
        bytes_per_step.append(sum(r["ep/sent_bytes"]))
        out["steps"] += 1
    out["off_rank_fraction"] = (min(fractions), statistics.median(fractions), max(fractions))
    out["sent_bytes_per_step"] = statistics.median(bytes_per_step)
    out["records"] = records
    out["accum"], out["full_ac"] = accum, full_ac
    return out


def timing(args: argparse.Namespace) -> dict[str, list[list[dict]]]:
    arms = [arm for arm in ARMS if arm in args.arms]
    runs: dict[str, list[list[dict]]] = {arm: [] for arm in arms}
    rows = []
    for round_ in range(args.rounds):
        order = arms[round_ % len(arms) :] + arms[: round_ % len(arms)]
        row = {}
        for arm in order:
            ranks, layout = ARMS[arm]
            before = loads()
            started = time.perf_counter()
            records, cpu = train_run(ranks, layout, steps=args.steps)
            runs[arm].append(records)
            row[arm] = steady_tok_s(records, args.skip)
            row[arm + " cpu"] = cpu
            print(
                f"round {round_ + 1} {arm}: {row[arm]:,.0f} tok/s, "
                f"{time.perf_counter() - started:.0f} s wall, {cpu:.0f} s CPU "
                f"(load before: {before})",
                flush=True,
            )
        rows.append(row)

    print(f"\n### Step time: {GLOBAL_BATCH} x 256 tokens per step, {args.rounds} rounds")
    print(f"({args.steps} steps per run, steps > {args.skip} counted; ratio to ep=1 per round)\n")
    print(
        "| arm | ranks x threads | median tok/s | min | max | step (ms) | ratio to ep=1 "
        "(median, min-max) | ep / dp_shard at the same ranks (median, min-max) | "
        "all-to-all share of the step | all-to-all ms per step | CPU s per run (median) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for arm in arms:
        ranks, _ = ARMS[arm]
        values = [row[arm] for row in rows]
        ratios = [row[arm] / row["ep=1"] for row in rows]
        median = statistics.median(values)
        counted = [r for run in runs[arm] for r in run if r["step"] > args.skip]
        if "ep/all_to_all_share" in counted[0]:
            share = [statistics.mean(r["ep/all_to_all_share"]) for r in counted]
            ms = [statistics.mean(r["ep/all_to_all_ms"]) for r in counted]
            a2a = f"{statistics.median(share):.3f} (rank mean)"
            a2a_ms = f"{statistics.median(ms):.0f}"
        else:
            a2a = a2a_ms = "-"
        threads = "1 x 2" if ranks == 1 else f"{ranks} x 1"
        twin = f"dp_shard={ranks}"
        if arm.startswith("ep=") and ranks > 1 and twin in arms:
            pair = [row[arm] / row[twin] for row in rows]
            versus = f"{statistics.median(pair):.3f} ({min(pair):.3f}-{max(pair):.3f})"
        else:
            versus = "-"
        print(
            f"| {arm} | {threads} | {median:,.0f} | {min(values):,.0f} | {max(values):,.0f} | "
            f"{GLOBAL_BATCH * 256 / median * 1e3:.0f} | {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f}) | {versus} | {a2a} | {a2a_ms} | "
            f"{statistics.median(row[arm + ' cpu'] for row in rows):.0f} |"
        )
    print("\nper-rank all-to-all share, median over the counted steps of all runs:")
    for arm in arms:
        counted = [r for run in runs[arm] for r in run if r["step"] > args.skip]
        if "ep/all_to_all_share" in counted[0]:
            columns = zip(*(r["ep/all_to_all_share"] for r in counted), strict=True)
            print(f"  {arm}: {[round(statistics.median(c), 3) for c in columns]}")
    rss = {arm: max(r["max_rss_gb"] for run in runs[arm] for r in run) for arm in arms}
    print("max_rss_gb of the records (rank 0):", rss)
    return runs


def bytes_report(runs: dict[str, list[list[dict]]], args: argparse.Namespace) -> None:
    checks = []
    for arm in ("ep=2", "ep=4"):
        if runs.get(arm):
            ep = int(arm.removeprefix("ep="))
            records = [r for run in runs[arm] for r in run]
            label = f"{arm} ({len(runs[arm])} timing runs)"
            checks.append((label, check_bytes(records, ep=ep, accum=1, full_ac=False)))
    extra = [
        ("ep=2, no AC (control)", 2, [], 1),
        ("ep=2, full AC", 2, ["--train.activation_checkpointing=full"], 1),
        ("ep=4, full AC", 4, ["--train.activation_checkpointing=full"], 1),
        ("ep=2, 2 micro-batches", 2, [], 2),
    ]
    for label, ep, overrides, accum in extra:
        print(f"{label}: load before {loads()}", flush=True)
        layout = ARMS[f"ep={ep}"][1]
        records, _ = train_run(ep, layout, steps=args.check_steps, extra=overrides, accum=accum)
        full_ac = bool(overrides)
        checks.append((label, check_bytes(records, ep=ep, accum=accum, full_ac=full_ac)))

    print("\n### All-to-all bytes per step: measured against the routing\n")
    print(
        "| run | step records checked | sent bytes per step, all ranks (median) | measured = "
        "expected (sent and received, every rank, every step) | loads identity (every rank, "
        "every step) | off-rank fraction of the copies (min / median / max) | (ep-1)/ep |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, c in checks:
        ep = len(c["records"][0]["ep/sent_tokens"])
        lo, mid, hi = c["off_rank_fraction"]
        ok_bytes = "yes" if not c["bytes_mismatch"] else f"NO: {c['bytes_mismatch'][:3]}"
        ok_loads = "yes" if not c["loads_mismatch"] else f"NO: {c['loads_mismatch'][:3]}"
        print(
            f"| {label} | {c['steps']} | {c['sent_bytes_per_step'] / 1e6:.3f} MB | {ok_bytes} | "
            f"{ok_loads} (max dev {c['loads_dev']:.1e}) | {lo:.3f} / {mid:.3f} / {hi:.3f} | "
            f"{(ep - 1) / ep:.3f} |"
        )

    # The recompute routes the same tokens: full AC's counts should equal the control's (x1).
    control = next(c for label, c in checks if label == "ep=2, no AC (control)")
    plain = {r["step"]: r for r in control["records"]}
    ac = next(c for label, c in checks if label == "ep=2, full AC")["records"]
    ratios = {
        s / p
        for r in ac
        for s, p in zip(
            r["ep/sent_tokens"] + r["ep/received_tokens"],
            plain[r["step"]]["ep/sent_tokens"] + plain[r["step"]]["ep/received_tokens"],
            strict=True,
        )
    }
    losses = all(r["loss"] == plain[r["step"]]["loss"] for r in ac)
    print(
        f"\nep=2 full AC against ep=2 without ({len(ac)} steps each, same schedule): logged "
        f"token copies x{sorted(ratios)}, losses identical: {losses}"
    )
    dim = model_shape()[0]
    print("\nexample records (step 2 of the first run of each case, rank lists):")
    for label, c in checks:
        r = next(x for x in c["records"] if x["step"] == 2)
        layers = {k: v for k, v in r.items() if k.startswith("moe/load/")}
        ep = len(r["ep/sent_tokens"])
        per_rank = len(next(iter(layers.values()))) // ep
        on_rank = [
            round(sum(sum(v[i * per_rank : (i + 1) * per_rank]) for v in layers.values()), 4)
            for i in range(ep)
        ]
        print(
            f"  {label}: sent_tokens {r['ep/sent_tokens']} received_tokens "
            f"{r['ep/received_tokens']} sent_bytes {r['ep/sent_bytes']} "
            f"(row {dim * 4} B) load on each rank's experts {on_rank}"
        )


def memory(args: argparse.Namespace) -> None:
    print(
        f"\n### Memory per rank: {' '.join(MEMORY_MODEL)}, {MEMORY_BATCH_PER_RANK} x 256 "
        f"tokens per rank, {args.memory_steps} steps\n"
    )
    print(
        "| layout | ranks | routed experts, local MB (of total) | other params, local MB | "
        "AdamW state, experts / other MB | RSS before the Trainer MB | RSS with the model "
        "built MB | peak RSS MB (rank min-max) | peak - before MB | load before |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, ranks, layout in MEMORY_LAYOUTS:
        before = loads()
        overrides = [
            *MEMORY_MODEL,
            *COMMON,
            f"--train.batch_size={MEMORY_BATCH_PER_RANK}",
            f"--train.max_steps={args.memory_steps}",
            *layout,
        ]
        done, _ = launch(ranks, [__file__, "worker", *overrides], label)
        line = next(x for x in done.stdout.splitlines() if x.startswith("MEMORY "))
        per_rank = json.loads(line.removeprefix("MEMORY "))

        def mb(key: str, ranks: list[dict] = per_rank) -> str:
            values = sorted({round(r[key] / 1e6, 1) for r in ranks})
            return " / ".join(f"{v:.1f}" for v in values)

        total = per_rank[0]["expert_total"] / 1e6
        peak = [r["peak_rss"] / 1e6 for r in per_rank]
        grown = [(r["peak_rss"] - r["rss_before"]) / 1e6 for r in per_rank]
        print(
            f"| {label} | {ranks} | {mb('expert_local')} (of {total:.1f}) | {mb('other_local')} "
            f"| {mb('expert_state')} / {mb('other_state')} | {mb('rss_before')} | "
            f"{mb('rss_built')} | {min(peak):.0f}-{max(peak):.0f} | "
            f"{min(grown):.0f}-{max(grown):.0f} | {before} |",
            flush=True,
        )


def worker(overrides: list[str]) -> None:
    """Under torchrun (or alone): build the Trainer, take the steps, report this rank's bytes."""
    import resource

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from kiln.config import load_config
    from kiln.train.trainer import Trainer

    def rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    rss_before = rss()
    with tempfile.TemporaryDirectory(prefix="kiln-ep-memory-") as tmp:
        cfg = load_config(RECIPE, [*overrides, f"--metrics.run_dir={tmp}/run"])
        trainer = Trainer(cfg)
        rss_built = rss()
        for _ in range(cfg.train.max_steps):
            trainer.train_step()
        figures = dict.fromkeys(
            ("expert_local", "other_local", "expert_total", "expert_state", "other_state"), 0
        )
        expert_ids = set()
        for part in trainer.model_parts:
            for name, p in part.named_parameters():
                nbytes = local(p).numel() * p.element_size()
                if ".experts.w" in name:
                    expert_ids.add(id(p))
                    figures["expert_local"] += nbytes
                    figures["expert_total"] += p.numel() * p.element_size()
                else:
                    figures["other_local"] += nbytes
        for optimizer in (o for part in trainer.optimizers for o in part):
            for p, state in optimizer.state.items():
                key = "expert_state" if id(p) in expert_ids else "other_state"
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        figures[key] += local(value).numel() * value.element_size()
        figures["rss_before"], figures["rss_built"] = rss_before, rss_built
        figures["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, figures)
            main = dist.get_rank() == 0
        else:
            gathered, main = [figures], True
        if main:
            print("MEMORY " + json.dumps(gathered), flush=True)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three arms")
    parser.add_argument("--steps", type=int, default=14, help="steps per timing run")
    parser.add_argument("--skip", type=int, default=4, help="steps not counted (warm-up)")
    parser.add_argument("--check-steps", type=int, default=4, help="steps of the extra runs")
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-only", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    print(f"load average at start: {loads()}", flush=True)
    if not args.memory_only:
        runs = timing(args)
        bytes_report(runs, args)
    if not args.no_memory:
        memory(args)
    print(f"\nload average at end: {loads()}; wall {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
