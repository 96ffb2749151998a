"""kiln against a hand-written loop and torchtitan on one GPU: tok/s, MFU, kiln's overhead.

Three trainers of the same model (kiln's Llama shapes, untied head: torchtitan's Llama has no
tied one), batch, sequence, precision and tokens, each in its own process, alternating
(kiln, torchtitan, hand loop, kiln, ...) so drift hits all alike:

- kiln: `kiln train` as a user runs it; tok/s from its metrics.jsonl after the warm-up steps.
- hand loop: kiln's Transformer built the same way (meta device, FP8 swap, per-block compile,
  `materialize`), plain torch around it: bf16 autocast over fp32 weights (kiln's one-process
  mixed precision), cross entropy, `clip_grad_norm_`, fused AdamW, batches read up front.
- torchtitan: its trainer on the same shapes (benchmarks/torchtitan_launcher.py), when
  importable; otherwise the reason is recorded.

The hand loop and the GEMM timings run in processes of benchmarks/side_by_side_workers.py.

MFU uses kiln's FLOP count over the GPU's dense bf16 peak (kiln/metrics/mfu.py) and over the
rate `torch.mm` (`torch._scaled_mm` for FP8 layers) reaches on the model's own GEMM shapes,
measured here: the roofline a step can approach. Writes side_by_side.json (raw) and
side_by_side.md (table) into --out. --budget-s stops starting runs once it is spent.

    python benchmarks/gpu_side_by_side.py --out /tmp/sbs                      # ~3 min, H100
    python benchmarks/gpu_side_by_side.py --models all --modes all --rounds 3 --budget-s 0
    python benchmarks/gpu_side_by_side.py --device cpu --out /tmp/sbs        # dry run, debug model
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKERS = REPO / "benchmarks/side_by_side_workers.py"
RECIPE = "configs/train/demo.toml"
FRAMEWORKS = ("kiln", "hand", "torchtitan", "hand_sync")
# torchtitan before the hand loop: the hand loop compiles kiln's blocks, which kiln's run has
# just cached, so it is the quickest and the likeliest to fit in what --budget-s leaves.
RUN_ORDER = ("kiln", "torchtitan", "hand", "hand_sync")
# Model: kiln preset, batch, seq, whether the layer count is fitted to the GPU.
MODELS = {
    "llama3_1b": ("llama3_1b", 4, 2048, False),
    "llama3_8b_layers": ("llama3_8b", 2, 2048, True),  # Llama-3 8B's layer shapes, fewer layers
    "debug": ("debug", 4, 128, False),  # the --device cpu dry run
}
MODES = {
    "bf16 eager": ("bf16", False),
    "bf16 compiled": ("bf16", True),
    "fp8 compiled": ("fp8", True),
}
# kiln check's memory model misses eager runs by up to 11% (benchmarks/planner.md): headroom.
FIT_MARGIN, FIT_FRACTION = 1.25, 0.92


@dataclasses.dataclass(frozen=True)
class Variant:
    model: str
    mode: str
    batch: int
    seq: int
    layers: int | None  # None: the preset's

    @property
    def name(self) -> str:
        layers = f" ({self.layers} layers)" if self.layers else ""
        return f"{self.model}{layers}, {self.mode}, {self.batch}x{self.seq}"

    @property
    def fp8(self) -> bool:
        return MODES[self.mode][0] == "fp8"


def kiln_overrides(v: Variant, args: argparse.Namespace) -> list[str]:
    """The `--section.key=value` overrides of RECIPE that all three sides train with."""
    precision, compiled = MODES[v.mode]
    out = [
        f'--model.preset="{MODELS[v.model][0]}"',
        "--model.tie_embeddings=false",
        f"--train.seq_len={v.seq}",
        f"--train.batch_size={v.batch}",
        f"--train.max_steps={args.steps}",
        f'--train.mixed_precision="{precision}"',
        f"--train.compile={str(compiled).lower()}",
        '--train.activation_checkpointing="none"',
        f'--train.device="{args.device}"',
        f'--data.path="{args.data}"',
        "--scheduler.warmup_steps=2",
        "--checkpoint.interval=0",
        "--checkpoint.save_final=false",
        f"--metrics.log_interval={args.log_every}",
        "--metrics.plot=false",
    ]
    if v.fp8:
        out.append('--fp8.recipe="tensorwise"')
    if v.layers:
        out.append(f"--model.n_layers={v.layers}")
    return out


def job_config(v: Variant, args: argparse.Namespace):
    """kiln's JobConfig of a variant (for FLOPs, GEMM shapes and the data)."""
    from kiln.config import load_config

    return load_config(REPO / RECIPE, kiln_overrides(v, args))


def fit_layers(total_bytes: float, batch: int, seq: int) -> int:
    """Most Llama-3-8B-shaped layers whose training (AC none) fits the GPU, by kiln's planner."""
    from kiln.config import load_config
    from kiln.plan.memory import CONTEXT_BYTES, estimate_memory

    one = dict.fromkeys(("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"), 1)
    best = 1
    for layers in range(1, 33):
        cfg = load_config(
            REPO / RECIPE,
            [
                '--model.preset="llama3_8b"',
                f"--model.n_layers={layers}",
                f"--train.batch_size={batch}",
                f"--train.seq_len={seq}",
                '--train.mixed_precision="bf16"',
                '--train.activation_checkpointing="none"',
            ],
        )
        need = estimate_memory(cfg, one).reserved * FIT_MARGIN + CONTEXT_BYTES
        if need > FIT_FRACTION * total_bytes:
            break
        best = layers
    return best


# ---- GEMM roofline -------------------------------------------------------------------------


def gemm_shapes(m, tokens: int) -> list[tuple[int, int, int, int, bool]]:
    """(M, K, N, count per step, float8) of every matmul of a step: each linear layer's forward,
    input gradient and weight gradient; the output head stays high precision under FP8."""
    hd, ffn = m.resolved_head_dim, m.ffn_hidden_dim
    linears = [
        (m.dim, m.n_heads * hd),
        (m.dim, m.n_kv_heads * hd),
        (m.dim, m.n_kv_heads * hd),
        (m.n_heads * hd, m.dim),
        (m.dim, ffn),
        (m.dim, ffn),
        (ffn, m.dim),
    ]
    rows = []
    for (fan_in, fan_out), count, fp8 in [(lin, m.n_layers, True) for lin in linears] + [
        ((m.dim, m.vocab_size), 1, False)
    ]:
        for mkn in (
            (tokens, fan_in, fan_out),
            (tokens, fan_out, fan_in),
            (fan_out, tokens, fan_in),
        ):
            rows.append((*mkn, count, fp8))
    return rows


def roofline(shapes, times: dict[tuple, float], fp8: bool) -> float:
    """FLOP/s of the step's GEMMs run back to back at the measured rates."""
    flops = seconds = 0.0
    for m, k, n, count, eligible in shapes:
        kind = "fp8" if fp8 and eligible else "bf16"
        flops += 2 * m * k * n * count
        seconds += times[(m, k, n, kind)] * count
    return flops / seconds


# ---- runs and results ----------------------------------------------------------------------


def steady_rate(records: list[dict], warmup: int) -> float | None:
    """tok/s of the steps after `warmup`: each record's rate covers the steps since the record
    before it, and every step trains the same tokens, so the time of a window of n steps is
    n · tokens / rate and the rate over all of them is their steps / the sum of n / rate."""
    records = sorted((r for r in records if r.get("tokens_per_sec")), key=lambda r: r["step"])
    steps = per_token = 0.0
    for before, record in itertools.pairwise(records):
        if before["step"] >= warmup:
            count = record["step"] - before["step"]
            steps += count
            per_token += count / record["tokens_per_sec"]
    return steps / per_token if per_token else None


def command(framework: str, v: Variant, args: argparse.Namespace, run_dir: Path) -> list[str]:
    py = [sys.executable]
    if framework == "kiln":
        run_dir_key = f'--metrics.run_dir="{run_dir}"'
        return [*py, "-m", "kiln", "train", RECIPE, *kiln_overrides(v, args), run_dir_key]
    common = [
        f"--model={v.model}", f"--mode={v.mode}", f"--batch={v.batch}", f"--seq={v.seq}",
        f"--steps={args.steps}", f"--log-every={args.log_every}", f"--device={args.device}",
        f"--data={args.data}", f"--result={run_dir / 'result.json'}",
    ]  # fmt: skip
    if v.layers:
        common.append(f"--layers={v.layers}")
    if framework == "hand":
        return [*py, str(WORKERS), "hand", *common]
    if framework == "hand_sync":  # the price of one read per step (kiln's non-finite check)
        return [*py, str(WORKERS), "hand", *common, "--read-every-step"]
    return [*py, str(REPO / "benchmarks/torchtitan_launcher.py"), *common]


def run(framework: str, v: Variant, args, run_dir: Path, timeout: float) -> dict:
    """One training process; its steady tok/s and peak memory, or why there are none."""
    run_dir.mkdir(parents=True)
    log = run_dir / "output.log"
    began = time.monotonic()
    try:
        with open(log, "w") as out:
            done = subprocess.run(
                command(framework, v, args, run_dir), cwd=REPO, env=environment(),
                stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
            )  # fmt: skip
        failed = done.returncode != 0 and f"exit {done.returncode}"
    except subprocess.TimeoutExpired:
        failed = f"timed out after {timeout:.0f} s"
    result = {"framework": framework, "wall_s": round(time.monotonic() - began, 1)}
    if failed:
        lines = log.read_text(errors="replace").strip().splitlines() or ["(no output)"]
        return result | {"error": f"{failed}: {lines[-1].removeprefix('[rank0]: ')[-300:]}"}
    try:
        records, peak = read_records(framework, run_dir)
    except (OSError, ValueError, KeyError) as error:
        return result | {"error": f"no records: {error}"}
    rate = steady_rate(records, args.warmup)
    if rate is None:
        return result | {"error": "no logged window after the warm-up steps"}
    return result | {"tok_s": rate, "peak_mem_gb": peak, "records": records}


def read_records(framework: str, run_dir: Path) -> tuple[list[dict], float | None]:
    """A run's logged records and its peak allocated memory (GB)."""
    if framework == "kiln":
        records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return records, max((r.get("peak_mem_gb") or 0.0 for r in records), default=None)
    raw = json.loads((run_dir / "result.json").read_text())
    return raw["records"], raw.get("peak_mem_gb")


def environment() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def torchtitan_probe() -> str:
    """ "torchtitan VERSION" when its trainer imports here, else "torchtitan: why not"."""
    probe = "import torchtitan.train, torchtitan.models.llama3; print(torchtitan.__version__)"
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], env=environment(), capture_output=True, text=True,
            timeout=180,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return "torchtitan: import timed out"
    if done.returncode == 0:
        return f"torchtitan {done.stdout.strip()}"
    last = (done.stderr.strip().splitlines() or ["?"])[-1]
    if "No module named 'torchtitan'" in last:
        return "torchtitan: not installed"
    return f"torchtitan: not importable ({last})"


def variants(args: argparse.Namespace, memory_bytes: float | None) -> list[Variant]:
    out = []
    for model in expand(args.models, MODELS):
        _, batch, seq, fitted = MODELS[model]
        batch, seq = args.batch or batch, args.seq or seq
        layers = None
        if fitted:
            layers = args.layers or (fit_layers(memory_bytes, batch, seq) if memory_bytes else 2)
        out += [Variant(model, mode, batch, seq, layers) for mode in expand(args.modes, MODES)]
    return out


def expand(names: list[str], table: dict) -> list[str]:
    """["all"]: every GPU entry of `table` (not the CPU dry run's debug model)."""
    return [n for n in table if n != "debug"] if names == ["all"] else names


def measure_rooflines(vs: list[Variant], args, work: Path) -> tuple[dict, dict[str, float]]:
    """Device facts and, per variant name, the GEMM roofline in FLOP/s (one worker process;
    no variants: the device facts alone)."""
    shapes = {v.name: (gemm_shapes(job_config(v, args).model, v.batch * v.seq), v.fp8) for v in vs}
    unique = set()
    for rows, fp8 in shapes.values():
        for m, k, n, _, eligible in rows:
            unique |= {(m, k, n, "bf16"), *([(m, k, n, "fp8")] if fp8 and eligible else [])}
    unique = sorted(unique)
    (work / "shapes.json").write_text(json.dumps(unique))
    command = [sys.executable, str(WORKERS), "gemm", f"--device={args.device}"]
    command += [f"--shapes={work / 'shapes.json'}", f"--result={work / 'gemm.json'}"]
    with open(work / "gemm.log", "w") as log:
        done = subprocess.run(
            command, cwd=REPO, env=environment(), stdout=log, stderr=subprocess.STDOUT, timeout=300
        )
    if done.returncode:
        sys.exit(f"the GEMM worker failed:\n{(work / 'gemm.log').read_text()[-2000:]}")
    raw = json.loads((work / "gemm.json").read_text())
    times = {tuple(key): t for key, t in zip(unique, raw["times"], strict=True)}
    return raw["device"], {name: roofline(rows, times, fp8) for name, (rows, fp8) in shapes.items()}


def main_run(args: argparse.Namespace) -> dict:
    from kiln.model import flops_per_token

    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kiln-sbs-"))
    print(f"runs and their logs in {work}", flush=True)
    if not (REPO / args.data / "index.json").exists():  # built once, before any clock runs
        subprocess.run(
            [sys.executable, "-m", "kiln", "prepare", "--demo", "--output", args.data],
            cwd=REPO, env=environment(), check=True,
        )  # fmt: skip
    titan = torchtitan_probe() if "torchtitan" in args.frameworks else "torchtitan: not run"
    memory = None
    if args.layers is None and any(MODELS[m][3] for m in expand(args.models, MODELS)):
        memory = measure_rooflines([], args, work)[0]["memory_bytes"]  # to fit the layers
    vs = variants(args, memory)
    device, rooflines = measure_rooflines(vs, args, work)
    results = {
        "device": device,
        "torchtitan": titan,
        "work_dir": str(work),
        "settings": vars(args),
        "variants": [],
    }
    for number, v in enumerate(vs):
        entry = {"variant": v.name, **dataclasses.asdict(v), "runs": []}
        entry["flops_per_token"] = flops_per_token(job_config(v, args).model, v.seq)
        entry["gemm_roofline_flops"] = rooflines[v.name]
        results["variants"].append(entry)
        for round_ in range(args.rounds):
            for framework in (f for f in RUN_ORDER if f in args.frameworks):
                if framework == "torchtitan" and titan.startswith("torchtitan:"):
                    continue
                if any(r["framework"] == framework and "error" in r for r in entry["runs"]):
                    continue  # it failed in an earlier round: no time spent failing again
                left = args.budget_s - (time.monotonic() - began) if args.budget_s else 1e9
                run_dir = work / f"{number}-{round_}-{framework}"
                if left < args.min_run_s:
                    outcome = {"framework": framework, "skipped": "--budget-s spent"}
                else:
                    outcome = run(framework, v, args, run_dir, min(args.run_timeout_s, left))
                entry["runs"].append({"round": round_, **outcome})
                print(f"{v.name} | {framework} | round {round_} | {brief(outcome)}", flush=True)
    results["elapsed_s"] = round(time.monotonic() - began, 1)
    return results


def brief(outcome: dict) -> str:
    if "tok_s" in outcome:
        return f"{outcome['tok_s']:,.0f} tok/s ({outcome['wall_s']} s)"
    return outcome.get("error") or outcome.get("skipped", "?")


def summarize(results: dict) -> list[dict]:
    """Per variant and framework: tok/s per round and median, MFU, share of the GEMM
    roofline, and kiln's tok/s over this framework's, the median of the per-round ratios."""
    peak = results["device"].get("peak_bf16_flops")
    rows = []
    for entry in results["variants"]:
        by_round: dict[int, dict[str, float]] = {}
        for r in entry["runs"]:
            if "tok_s" in r:
                by_round.setdefault(r["round"], {})[r["framework"]] = r["tok_s"]
        for framework in results["settings"]["frameworks"]:
            runs = [r for r in entry["runs"] if r["framework"] == framework]
            rates = [r["tok_s"] for r in runs if "tok_s" in r]
            ratios = [
                rs["kiln"] / rs[framework]
                for rs in by_round.values()
                if "kiln" in rs and framework in rs
            ]
            rate = statistics.median(rates) if rates else None
            achieved = rate * entry["flops_per_token"] if rate else None
            notes = sorted({brief(r) for r in runs if "tok_s" not in r})
            if framework == "torchtitan" and results["torchtitan"].startswith("torchtitan:"):
                notes = [results["torchtitan"]]
            rows.append({
                "variant": entry["variant"], "framework": framework, "rounds": rates,
                "tok_s": rate, "mfu": achieved / peak if achieved and peak else None,
                "of_gemm_roofline": achieved / entry["gemm_roofline_flops"] if achieved else None,
                "peak_mem_gb": max((r.get("peak_mem_gb") or 0 for r in runs), default=None),
                "kiln_over_this": statistics.median(ratios) if ratios and framework != "kiln" else None,
                "notes": notes,
            })  # fmt: skip
    return rows


def markdown(results: dict, rows: list[dict]) -> str:
    d = results["device"]
    peak = d.get("peak_bf16_flops")
    lines = [
        f"Device: {d['name']}; torch {d['torch']} (CUDA {d['cuda']}), torchao {d['torchao']}; "
        f"{results['torchtitan']}; dense bf16 peak "
        + (f"{peak / 1e12:.0f} TFLOP/s" if peak else "unknown (no MFU)"),
        f"Steps per run {results['settings']['steps']}, tok/s over steps "
        f"{results['settings']['warmup'] + 1}-{results['settings']['steps']}; "
        f"{results['elapsed_s']} s in all. Untied output head on every side.",
        "",
        "| variant | framework | tok/s per round | tok/s | MFU | of GEMM roofline | peak GB "
        "| kiln ÷ this | notes |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    roof = {e["variant"]: e["gemm_roofline_flops"] for e in results["variants"]}
    for r in rows:
        cells = [
            r["variant"], r["framework"], ", ".join(f"{x:,.0f}" for x in r["rounds"]) or "-",
            f"{r['tok_s']:,.0f}" if r["tok_s"] else "-", pct(r["mfu"]), pct(r["of_gemm_roofline"]),
            f"{r['peak_mem_gb']:.1f}" if r["peak_mem_gb"] else "-",
            f"{r['kiln_over_this']:.3f}" if r["kiln_over_this"] else "-", "; ".join(r["notes"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "GEMM roofline (torch.mm / torch._scaled_mm on each variant's GEMM shapes):"]
    lines += [f"- {name}: {rate(flops)}" for name, flops in roof.items()]
    return "\n".join(lines) + "\n"


def rate(flops: float) -> str:
    return f"{flops / 1e12:.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.2f} GFLOP/s"


def pct(x: float | None) -> str:
    return f"{100 * x:.1f}%" if x is not None else "-"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--models", nargs="+", default=None, help=f"{list(MODELS)} or all")
    p.add_argument("--modes", nargs="+", default=None, help=f"{list(MODES)} or all")
    p.add_argument(
        "--frameworks",
        nargs="+",
        default=list(FRAMEWORKS[:3]),
        choices=FRAMEWORKS,
        help="hand_sync: the hand loop reading one flag per step, as kiln's non-finite check does",
    )
    p.add_argument("--rounds", type=int, default=2, help="alternations of the frameworks")
    p.add_argument("--steps", type=int, default=None, help="steps per run (20; cpu: 6)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out (5; cpu: 2)")
    p.add_argument("--log-every", type=int, default=None, help="(5; cpu: 2)")
    p.add_argument("--batch", type=int, default=None, help="instead of the model's")
    p.add_argument("--seq", type=int, default=None, help="instead of the model's")
    p.add_argument("--layers", type=int, default=None, help="8B-shaped layers (default: fit)")
    p.add_argument("--data", default="data/demo")
    p.add_argument("--budget-s", type=float, default=170, help="start no run after (0: none)")
    p.add_argument("--min-run-s", type=float, default=40, help="least time left to start one")
    p.add_argument("--run-timeout-s", type=float, default=240)
    p.add_argument("--out", default=None, help="folder for side_by_side.json and .md")
    return p


def defaults(args: argparse.Namespace) -> argparse.Namespace:
    cpu = args.device == "cpu"
    args.models = args.models or (["debug"] if cpu else ["llama3_1b"])
    args.modes = args.modes or (["bf16 eager"] if cpu else ["bf16 compiled"])
    args.steps = args.steps or (6 if cpu else 20)
    args.warmup = args.warmup if args.warmup is not None else (2 if cpu else 5)
    args.log_every = args.log_every or (2 if cpu else 5)
    return args


def main() -> None:
    args = defaults(parser().parse_args())
    results = main_run(args)
    rows = summarize(results)
    results["summary"] = rows
    table = markdown(results, rows)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "side_by_side.json").write_text(json.dumps(results, indent=1))
        (out / "side_by_side.md").write_text(table)


if __name__ == "__main__":
    main()
