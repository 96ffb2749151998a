"""DeepSeek-V3 family on CPU, fp32, one process: step time against Llama, MTP's cost, MLA's memory.

1. Step time of the debug DeepSeek model (`deepseek_v3_debug`, MTP off) against Llama-style
   models with the same MoE keys and about the same active parameters.
2. Multi-token prediction (depth 1) against none: step time and the activation bytes one
   training forward saves for backward.
3. One attention layer, MLA (kiln/model/deepseek/mla.py) against GQA (kiln/model/llama/
   attention.py) at the same dim and heads: bytes saved for backward per token, measured with
   saved-tensor hooks, against the planner's `attention_bytes_per_token` (kiln/plan/).

Each step-time measurement is one process (`Trainer.train_step` on configs/train/debug.toml, as
`kiln train` runs it) timing --steps steps after --warmup; each round runs every model once, in
an order that rotates from round to round, so drift in the machine's load hits all alike. The
tables give the median over rounds of each process's mean step time, and ratios of those.

    python benchmarks/deepseek.py [--rounds 5 --steps 20 --warmup 3 --max-wait 600 --data data/demo]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = "configs/train/debug.toml"
# A measurement during which other processes kept more than this share of the cores busy is
# taken again, up to TRIES times while waiting for pytest is not given up, and marked if it
# stays so.
BUSY, TRIES = 0.15, 3
SEQ = 128  # the recipe's train.seq_len
DEEPSEEK = ["--model.preset=deepseek_v3_debug"]
# debug_moe turned into deepseek_v3_debug's shape where Llama has the key: 3 blocks, 4 heads
# with 4 KV heads, a dense first block 256 wide, and the DeepSeek preset's MoE keys exactly.
LLAMA = [
    "--model.preset=debug_moe",
    "--model.n_layers=3",
    "--model.n_kv_heads=4",
    "--model.ffn_hidden_dim=256",
    "--model.norm_eps=1e-6",
    "--model.moe.ffn_hidden_dim=64",
    "--model.moe.router=sigmoid",
    "--model.moe.route_norm=true",
    "--model.moe.route_scale=2.5",
    "--model.moe.n_groups=2",
    "--model.moe.topk_groups=1",
    "--model.moe.bias_update_rate=0.001",
    "--model.moe.seq_aux_loss_weight=0.0001",
    "--model.moe.aux_loss_weight=0",
    "--model.moe.router_z_loss_weight=0",
]
MODELS = {
    "deepseek_v3_debug, MTP off": [*DEEPSEEK, "--model.mtp.depth=0"],
    "deepseek_v3_debug, MTP depth 1": [*DEEPSEEK, "--model.mtp.depth=1"],
    # head_dim 16: GQA's four projections then weigh what MLA's do (active within 0.2%).
    "llama, head_dim 16 (matched)": [*LLAMA, "--model.head_dim=16"],
    "llama, head_dim 32 (dim / heads)": LLAMA,
}
BASE, MTP, MATCHED, WIDE = MODELS
TRAINER = """
import json, sys, tempfile, time
import torch
from kiln.config import load_config
from kiln.train.trainer import Trainer
mode, steps, warmup, overrides = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
run_dir = tempfile.mkdtemp(prefix="kiln-deepseek-")
cfg = load_config("configs/train/debug.toml", [*overrides, f"--metrics.run_dir={run_dir}",
                  "--checkpoint.interval=0", "--metrics.log_interval=1000000"])
cfg.train.max_steps = 10**9
trainer = Trainer(cfg)
for _ in range(warmup):
    trainer.train_step()
if mode == "time":
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    print(json.dumps({"ms": 1e3 * (time.perf_counter() - start) / steps}))
else:
    storages = {}
    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        trainer.train_step()
    state = {t.untyped_storage().data_ptr() for part in trainer.model_parts
             for t in (*part.parameters(), *part.buffers())}
    print(json.dumps({"activations": sum(n for p, n in storages.items() if p not in state),
                      "state": sum(n for p, n in storages.items() if p in state),
                      "tokens": cfg.train.batch_size * cfg.train.seq_len}))
"""


def run_trainer(mode: str, overrides: list[str], *, steps: int = 0, warmup: int = 0) -> dict:
    """One process: `time` -> {"ms"}, `saved` -> the bytes one training step's forward saves."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", TRAINER, mode, str(steps), str(warmup), *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def model_config(overrides: list[str]):
    """The recipe's ModelConfig under `overrides`."""
    from kiln.config import load_config

    return load_config(RECIPE, overrides).model


def active_params(overrides: list[str]) -> tuple[int, int, int]:
    """(active, total) parameters and training FLOPs per token, as the family counts them."""
    from kiln.model.registry import family_of

    cfg = model_config(overrides)
    family = family_of(cfg)
    count = family.count_params(cfg)
    return count.active, count.total, family.flops_per_token(cfg, SEQ)


class Quiet:
    """Waits out other pytest runs and measures the CPU others took during a measurement."""

    def __init__(self, max_wait: float):
        self.left, self.waited, self.gave_up = max_wait, 0.0, False

    def wait(self) -> None:
        """Polls `pgrep -f pytest` every 15 s while one runs, within the run's waiting budget."""
        while subprocess.run(["pgrep", "-f", "pytest"], capture_output=True).stdout:
            if self.left <= 0:
                self.gave_up = True  # went on with one running
                return
            print(f"  waiting for pytest ({self.left:.0f} s of waiting left)", file=sys.stderr)
            time.sleep(15)
            self.left -= 15
            self.waited += 15

    @staticmethod
    def cpu_seconds() -> tuple[float, float, float]:
        """(wall clock, CPU seconds the machine spent busy, CPU seconds of finished children)."""
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait
        child = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.monotonic(), busy, child.ru_utime + child.ru_stime

    @classmethod
    def others_share(cls, before: tuple[float, float, float]) -> float:
        """The share of the machine's cores other processes kept busy since `before`."""
        wall, busy, child = (b - a for a, b in zip(before, cls.cpu_seconds(), strict=True))
        return max(0.0, busy - child) / (wall * (os.cpu_count() or 1))


def step_times(
    rounds: int, steps: int, warmup: int, data: list[str], quiet: Quiet
) -> dict[str, list[tuple[float, float]]]:
    """(mean step ms, others' CPU share) of each model, one process per model and round."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in MODELS}
    names = list(MODELS)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            for _ in range(TRIES):  # again, while others took the CPU
                quiet.wait()
                before = Quiet.cpu_seconds()
                ms = run_trainer("time", [*MODELS[name], *data], steps=steps, warmup=warmup)["ms"]
                share = Quiet.others_share(before)
                print(f"  round {r + 1}: {name}: {ms:.2f} ms, others {share:.0%}", file=sys.stderr)
                if share < BUSY or quiet.gave_up:  # no retries once waiting is given up
                    break
                time.sleep(15)
            times[name].append((ms, share))
    return times


# --- one attention layer -----------------------------------------------------------------------


def layer_saved_bytes(module, cfg, batch: int, seq: int, dtype, *, detail: bool = False):
    """Bytes one forward saves for backward (unique storages, not weights or rope tables)."""
    # With `detail`, also (shape, dtype, bytes) of each storage, in the order first saved.
    import torch

    from kiln.model.rope import model_rope_tables

    storages: dict[int, tuple[tuple[int, ...], str, int]] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in storages:
            name = str(tensor.dtype).removeprefix("torch.")
            storages[storage.data_ptr()] = (tuple(tensor.shape), name, storage.nbytes())
        return tensor

    width = cfg.mla.qk_rope_head_dim if cfg.family == "deepseek_v3" else None
    cos, sin = model_rope_tables(cfg, None, width=width)
    x = torch.randn(batch, seq, cfg.dim, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x, cos, sin)
    skip = {t.untyped_storage().data_ptr() for t in (*module.parameters(), cos, sin)}
    kept = [entry for ptr, entry in storages.items() if ptr not in skip]
    total = sum(entry[2] for entry in kept)
    return (total, kept) if detail else total


def attention_layers() -> list[tuple[str, object]]:
    """(label, ModelConfig) of the attention layers compared: the debug shape and a larger one."""
    mla = model_config(DEEPSEEK)
    debug = replace(mla, mtp=replace(mla.mtp, depth=0))
    # V2-Lite's attention (no query latent, a 512-wide KV latent, 128 + 64 / 128 per head) at
    # half its width and heads.
    large = replace(
        debug,
        dim=1024,
        n_heads=8,
        n_kv_heads=8,
        mla=replace(debug.mla, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128),
    )  # fmt: skip
    # A diagnostic: the debug MLA with values as wide as queries and keys (16 + 8), which CPU
    # SDPA's flash kernel takes; it refuses different widths and falls back to the math path.
    wide_v = replace(debug, mla=replace(debug.mla, v_head_dim=24))
    layers = []
    for shape, cfg in (("dim 128, 4 heads, seq 128", debug), ("dim 1024, 8 heads, seq 512", large)):
        for mla in (cfg, wide_v) if cfg is debug else (cfg,):
            m = mla.mla
            what = "MLA" if mla is cfg else "MLA, v widened (diagnostic)"
            layers.append(
                (
                    f"{shape} | {what} (q latent {m.q_lora_rank}, kv latent {m.kv_lora_rank}, "
                    f"qk {m.qk_nope_head_dim}+{m.qk_rope_head_dim}, v {m.v_head_dim})",
                    mla,
                )
            )
        for kv_heads in (cfg.n_heads, cfg.n_heads // 4):
            llama = replace(cfg, family="llama", n_kv_heads=kv_heads)
            hd = llama.resolved_head_dim
            layers.append((f"{shape} | GQA {cfg.n_heads} / {kv_heads} KV heads of {hd}", llama))
    return layers


def planned_bytes(cfg) -> tuple[float, float]:
    """The planner's bytes per token of the attention module: (bf16 as planned, fp32)."""
    # The block's attention norm is left out: the module is measured without it.
    from kiln.plan import activations, model_facts

    a = model_facts.attention(cfg)
    norm = 2 * cfg.dim + activations.RSTD_BYTES
    bf16 = activations.attention_bytes_per_token(cfg) - norm
    # Every 2-byte term doubles at fp32; the log-sum-exp and the latent norms' rstd stay 4.
    four = activations.LSE_BYTES * a.heads + activations.RSTD_BYTES * a.latent_norms
    return bf16, 2 * (bf16 - four) + four


def attention_memory(seq_of: dict[str, int]) -> tuple[list[str], dict[str, list[str]]]:
    """Rows of measured against planned bytes per token; the debug MLAs' storages by label."""
    import torch

    from kiln.model.deepseek.mla import MultiHeadLatentAttention
    from kiln.model.llama.attention import Attention

    torch.manual_seed(0)
    rows, detail = [], {}
    for label, cfg in attention_layers():
        seq = seq_of[label.split(" | ")[0]]
        build = MultiHeadLatentAttention if cfg.family == "deepseek_v3" else Attention
        measured = {}
        for dtype in (torch.float32, torch.bfloat16):
            module = build(cfg).to(dtype)
            # Per token: the difference between 4 and 2 sequences, so fixed costs drop out.
            at4 = layer_saved_bytes(module, cfg, 4, seq, dtype)
            measured[dtype] = (at4 - layer_saved_bytes(module, cfg, 2, seq, dtype)) / (2 * seq)
            if dtype == torch.bfloat16 and cfg.family == "deepseek_v3" and seq == 128:
                _, kept = layer_saved_bytes(module, cfg, 4, seq, dtype, detail=True)
                tokens = 4 * seq
                detail[label] = [f"| {s} | {d} | {n / tokens:.0f} |" for s, d, n in kept]
        bf16, fp32 = planned_bytes(cfg)
        f, b = measured[torch.float32], measured[torch.bfloat16]
        rows.append(
            f"| {label} | {f:.0f} | {fp32:.0f} | {f / fp32:.2f} | {b:.0f} | {bf16:.0f} | "
            f"{b / bf16:.2f} |"
        )
    return rows, detail


def header(args: argparse.Namespace) -> list[str]:
    """Command, device, date and torch version."""
    import torch

    cpu = "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    command = "python benchmarks/deepseek.py " + " ".join(sys.argv[1:])
    return [
        f"command: `{command.strip()}`",
        f"device: {cpu}, {os.cpu_count()} cores, 2 intra-op threads per process, fp32 "
        f"({platform.machine()})",
        f"date: {date.today().isoformat()}, torch {torch.__version__}",
        f"rounds {args.rounds}, {args.steps} timed steps after {args.warmup} warm-up, "
        "4 x 128 tokens a step",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--data", default="", help="a prepared dataset (default: the recipe's)")
    parser.add_argument("--max-wait", type=float, default=900, help="seconds to wait for pytest")
    args = parser.parse_args()
    data = [f"--data.path={args.data}"] if args.data else []

    counts = {name: active_params(overrides) for name, overrides in MODELS.items()}
    quiet = Quiet(args.max_wait)
    times = step_times(args.rounds, args.steps, args.warmup, data, quiet)
    saved = {name: run_trainer("saved", [*MODELS[name], *data], warmup=1) for name in (BASE, MTP)}
    seq_of = {"dim 128, 4 heads, seq 128": 128, "dim 1024, 8 heads, seq 512": 512}
    rows, detail = attention_memory(seq_of)

    busy = sum(share >= BUSY for runs in times.values() for _, share in runs)
    waited = f"waited {quiet.waited:.0f} s for other pytest runs to end" + (
        f", then went on with one running (--max-wait {args.max_wait:.0f})" if quiet.gave_up else ""
    )
    notes = [
        waited,
        f"{busy} step-time measurement(s) marked * ran while other processes kept "
        f">= {BUSY:.0%} of the cores busy ({TRIES} tries each); medians leave them out",
    ]
    out = [*(f"- {line}" for line in [*header(args), *notes]), ""]
    # The median over the measurements others left the machine to, or over all if none were.
    median = {
        name: statistics.median(
            [ms for ms, share in runs if share < BUSY] or [ms for ms, _ in runs]
        )
        for name, runs in times.items()
    }
    base_active = counts[BASE][0]
    out += [
        "| model | active params | total params | active / DeepSeek's | FLOPs/token (M) | "
        "ms/step (median) | per round |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (active, total, flops) in counts.items():
        rounds = ", ".join(
            f"{ms:.1f}" + ("*" if share >= BUSY else "") for ms, share in times[name]
        )
        out.append(
            f"| {name} | {active:,} | {total:,} | {active / base_active:.3f} | {flops / 1e6:.2f} | "
            f"{median[name]:.2f} | {rounds} |"
        )
    out += ["", "| ratio (medians of this run) | value |", "|---|---|"]
    for a, b in ((BASE, MATCHED), (BASE, WIDE), (MTP, BASE)):
        out.append(f"| {a} / {b} | {median[a] / median[b]:.3f} |")
    out += [
        "",
        "| model | activation bytes saved (MiB) | per token | weights saved (MiB) |",
        "|---|---|---|---|",
    ]
    for name, s in saved.items():
        out.append(
            f"| {name} | {s['activations'] / 2**20:.2f} | {s['activations'] / s['tokens']:,.0f} | "
            f"{s['state'] / 2**20:.2f} |"
        )
    a0, a1 = (saved[name]["activations"] for name in (BASE, MTP))
    out.append(
        f"| MTP depth 1 / off | {a1 / a0:.3f} | +{(a1 - a0) / saved[MTP]['tokens']:,.0f} | |"
    )
    out += [
        "",
        "| shape | attention | fp32 measured (B/token) | fp32 planned | measured / planned | "
        "bf16 measured | bf16 planned | measured / planned |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    for label, lines in detail.items():
        heading = "each storage saved, in order, bf16, 4 sequences (weights, rope tables left out)"
        out += ["", f"{label.replace(' | ', ', ')}: {heading}", ""]
        out += ["| shape | dtype | bytes per token |", "|---|---|---|", *lines]
    print("\n".join(out))


if __name__ == "__main__":
    main()
