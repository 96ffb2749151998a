"""The planner against published measurements: predicted vs measured memory and throughput for
every row, the orderings of layouts, and `kiln plan`'s wall time at 8,192 GPUs.

Pure arithmetic, CPU, seconds:

    .venv/bin/python benchmarks/planner.py > benchmarks/planner_table.md

benchmarks/planner.md quotes its output and says which term is wrong where the model misses.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kiln.config import config_from_dict
from kiln.plan.activations import KILN, Implementation
from kiln.plan.hardware import find_gpu, make_cluster
from kiln.plan.memory import estimate_memory
from kiln.plan.throughput import step_time

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
# The reference framework's benchmark page: H200 141 GB, 4 per node, InfiniBand; bf16, full AC,
# fused AdamW, compile on, seq_len 4096. Its MFU counts 6 × all parameters + 12·L·S·D (no causal
# halving); the tok/s below are its totals, and rows it gives as MFU only are converted back with
# that count.
REFERENCE = "reference framework, H200"
# torchtitan's Llama 3.1 tables: H100 with 96 GB HBM2e at a 500 W limit, 8 per node, 400 Gb/s
# RDMA per GPU; memory is the allocator's peak reserved, TPS per GPU.
TORCHTITAN = "torchtitan, H100 96 GB"


@dataclass
class Row:
    source: str
    name: str
    model: dict
    gpus: int
    layout: dict
    train: dict
    memory_gib: float | None = None  # measured
    tokens_per_sec: float | None = None  # measured, all GPUs together
    role: str = "held out"
    note: str = ""
    extra: dict = field(default_factory=dict)


def reference_tok_s(mfu: float, params: float, layers: int, dim: int, gpus: int) -> float:
    """tok/s behind an MFU the reference page gives, in its own FLOP count."""
    flops = 6 * params + 12 * layers * 4096 * dim
    return mfu * gpus * 989e12 / flops


DENSE = {"seq_len": 4096, "activation_checkpointing": "full"}
L7, L13, L70 = {"preset": "llama3_7b"}, {"preset": "llama3_13b"}, {"preset": "llama3_70b"}
P7, P13, P70 = 8_030_261_248, 14_839_572_480, 70_553_706_496  # count_params(...).total
ROWS = [
    Row(REFERENCE, "7B, 1 GPU", L7, 1, {}, {**DENSE, "batch_size": 4}, None, 10_471, "calibration"),
    Row(REFERENCE, "7B, FSDP=2", L7, 2, {"dp_shard": 2}, {**DENSE, "batch_size": 4}, None, 18_728),
    Row(REFERENCE, "7B, FSDP=4", L7, 4, {"dp_shard": 4}, {**DENSE, "batch_size": 4}, None, 38_983),
    Row(
        REFERENCE,
        "7B, TP=2 × FSDP=2",
        L7,
        4,
        {"dp_shard": 2, "tp": 2},
        {**DENSE, "batch_size": 4},
        None,
        reference_tok_s(0.359, P7, 32, 4096, 4),
    ),
    Row(
        REFERENCE,
        "7B, TP=4",
        L7,
        4,
        {"dp_shard": 1, "tp": 4},
        {**DENSE, "batch_size": 4},
        None,
        reference_tok_s(0.347, P7, 32, 4096, 4),
        "calibration",
    ),
    Row(
        REFERENCE,
        "7B, FSDP=8 (2 nodes)",
        L7,
        8,
        {"dp_shard": 8},
        {**DENSE, "batch_size": 4},
        None,
        8 * 10_471 * 0.53,
        note="from '53% of linear scaling'",
    ),
    Row(
        REFERENCE, "13B, FSDP=8", L13, 8, {"dp_shard": 8}, {**DENSE, "batch_size": 4}, None, 35_405
    ),
    Row(
        REFERENCE,
        "13B, TP=4 × FSDP=4",
        L13,
        16,
        {"dp_shard": 4, "tp": 4},
        {**DENSE, "batch_size": 4},
        None,
        53_814,
    ),
    Row(
        REFERENCE,
        "7B, TP=4 × FSDP=8",
        L7,
        32,
        {"dp_shard": 8, "tp": 4},
        {**DENSE, "batch_size": 4},
        27.6,
        reference_tok_s(0.269, P7, 32, 4096, 32),
    ),
    Row(
        REFERENCE,
        "13B, TP=4 × FSDP=8",
        L13,
        32,
        {"dp_shard": 8, "tp": 4},
        {**DENSE, "batch_size": 4},
        36.3,
        104_309,
    ),
    Row(
        REFERENCE,
        "70B, TP=4 × FSDP=8",
        L70,
        32,
        {"dp_shard": 8, "tp": 4},
        {**DENSE, "batch_size": 2},
        93.2,
        reference_tok_s(0.254, P70, 80, 8192, 32),
    ),
    Row(
        REFERENCE,
        "MoE 4B (8 experts top-2), TP=4 × EP=2 × FSDP=4",
        {"preset": "moe_4b"},
        32,
        {"dp_shard": 4, "tp": 4, "ep": 2},
        {"seq_len": 2048, "activation_checkpointing": "full", "batch_size": 12},
        106.7,
        27_000,
    ),
]
L8 = {"preset": "llama3_8b", "max_seq_len": 262_144}
TT = {"seq_len": 8192}
for gpus, memory, tps, compiled in ((8, 82.4, 5_762, ""), (8, 77.0, 6_667, " + compile")):
    ROWS.append(
        Row(
            TORCHTITAN,
            f"8B, FSDP=8, selective AC{compiled}",
            L8,
            gpus,
            {"dp_shard": 8},
            {**TT, "batch_size": 2, "activation_checkpointing": "selective"},
            memory,
            tps * gpus,
        )
    )
for memory, tps, compiled in ((67.0, 5_605, ""), (62.0, 6_514, " + compile")):
    ROWS.append(
        Row(
            TORCHTITAN,
            f"8B, FSDP=128, selective AC{compiled}",
            L8,
            128,
            {"dp_shard": 128},
            {**TT, "batch_size": 2, "activation_checkpointing": "selective"},
            memory,
            tps * 128,
        )
    )
for cp, seq, tps, memory in (
    (1, 32_768, 3_890, 83.9),
    (2, 65_536, 2_540, 84.2),
    (4, 131_072, 1_071, 84.0),
    (8, 262_144, 548, 84.5),
):
    ROWS.append(
        Row(
            TORCHTITAN,
            f"8B, FSDP={8 // cp} × CP={cp}, seq {seq:,}, full AC, compile + Float8",
            L8,
            8,
            {"dp_shard": 8 // cp, "cp": cp},
            {"seq_len": seq, "batch_size": 1, "activation_checkpointing": "full"},
            memory,
            tps * 8,
        )
    )
ROWS.append(
    Row(
        TORCHTITAN,
        "70B, FSDP=32 × TP=8, local batch 16, full AC, compile + Float8",
        {"preset": "llama3_70b", "max_seq_len": 8192},
        256,
        {"dp_shard": 32, "tp": 8},
        {**TT, "batch_size": 16, "activation_checkpointing": "full"},
        71.9,
        829 * 256,
    )
)


# kiln itself on one H100 80GB (benchmarks/gpu_runs.md): peak allocated in GB (10⁹ bytes),
# fused AdamW, bf16 autocast over fp32 masters, the built-in corpus, compiled unless "eager".
KILN_H100 = "kiln, one H100 80 GB"
for name, preset, seq, batch, ac, memory_gb, tps in (
    ("1B, eager, AC none", "llama3_1b", 2048, 4, "none", 46.96, 38_611),
    ("1B, AC none", "llama3_1b", 2048, 4, "none", 42.67, 46_004),
    ("1B, AC selective", "llama3_1b", 2048, 4, "selective", 36.99, 43_446),
    ("1B, AC full", "llama3_1b", 2048, 4, "full", 31.31, 40_869),
    ("1B, AC none, batch 2", "llama3_1b", 2048, 2, "none", 30.02, 36_015),
    ("1B, AC full, batch 2", "llama3_1b", 2048, 2, "full", 23.37, 31_859),
    ("3B, AC full, seq 4096", "llama3_3b", 4096, 2, "full", 57.09, 16_354),
):
    ROWS.append(
        Row(
            KILN_H100,
            name,
            {"preset": preset, "max_seq_len": seq},
            1,
            {},
            {"seq_len": seq, "batch_size": batch, "activation_checkpointing": ac},
            memory_gb * 1e9 / GIB,
            tps,
        )
    )


def predict(row: Row, impl: Implementation = KILN):
    raw = {"model": dict(row.model), "train": dict(row.train), "distributed": dict(row.layout)}
    cfg = config_from_dict(raw, world_size=row.gpus)
    degrees = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
    degrees.update(row.layout)
    if row.source == REFERENCE:
        cluster = make_cluster(find_gpu("h200"), row.gpus, 4)
    elif row.source == KILN_H100:
        cluster = make_cluster(find_gpu("h100"), 1, 1)
    else:
        cluster = make_cluster(find_gpu("h100", memory_gb=96), row.gpus, 8)
    return estimate_memory(cfg, degrees, impl), step_time(cfg, degrees, cluster)


def pct(predicted: float, measured: float) -> str:
    return f"{predicted / measured - 1:+.0%}"


def memory_table() -> None:
    print("| source | run | measured GiB | predicted GiB | error | largest terms (GiB) |")
    print("|---|---|---|---|---|---|")
    for row in ROWS:
        if row.memory_gib is None:
            continue
        memory, _ = predict(row)
        # The reference and kiln read the allocated peak, torchtitan the reserved one.
        value = memory.reserved if row.source == TORCHTITAN else memory.total
        terms = sorted(memory.terms().items(), key=lambda kv: -kv[1])[:3]
        shown = ", ".join(f"{k} {v / GIB:.1f}" for k, v in terms)
        print(
            f"| {row.source} | {row.name} | {row.memory_gib:.1f} | {value / GIB:.1f} | "
            f"{pct(value / GIB, row.memory_gib)} | {shown} |"
        )


def reference_without_sp_table() -> None:
    print("| run | measured GiB | predicted, TP without SP, logits gathered | error |")
    print("|---|---|---|---|")
    impl = Implementation(sequence_parallel=False, loss_parallel=False)
    for row in ROWS:
        if row.source == REFERENCE and row.memory_gib is not None:
            memory, _ = predict(row, impl)
            value = memory.total / GIB
            print(
                f"| {row.name} | {row.memory_gib:.1f} | {value:.1f} | {pct(value, row.memory_gib)} |"
            )


def throughput_table() -> None:
    print(
        "| source | run | GPUs | measured tok/s | predicted tok/s | error | predicted MFU | "
        "step: compute + bubble + exposed comm (s) | error if FSDP did not overlap | role |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in ROWS:
        _, step = predict(row)
        series = step.tokens / (step.compute + step.bubble + sum(step.comm.values()))
        print(
            f"| {row.source} | {row.name} | {row.gpus} | {row.tokens_per_sec:,.0f} | "
            f"{step.tokens_per_sec:,.0f} | {pct(step.tokens_per_sec, row.tokens_per_sec)} | "
            f"{step.mfu:.1%} | {step.compute:.2f} + {step.bubble:.2f} + {step.exposed:.2f} | "
            f"{pct(series, row.tokens_per_sec)} | "
            f"{row.role}{' (' + row.note + ')' if row.note else ''} |"
        )


def orderings() -> None:
    groups = {
        "7B on 4 GPUs": ["7B, FSDP=4", "7B, TP=2 × FSDP=2", "7B, TP=4"],
        "32 GPUs, MFU by model": ["13B, TP=4 × FSDP=8", "7B, TP=4 × FSDP=8", "70B, TP=4 × FSDP=8"],
        "torchtitan CP (TPS/GPU)": [r.name for r in ROWS if "CP=" in r.name],
        "kiln, 1B on one H100, AC modes (tok/s)": [
            "1B, AC none",
            "1B, AC selective",
            "1B, AC full",
        ],
        "best run at each GPU count (MFU)": [
            "7B, 1 GPU",
            "7B, FSDP=2",
            "7B, FSDP=4",
            "13B, FSDP=8",
            "13B, TP=4 × FSDP=4",
            "13B, TP=4 × FSDP=8",
        ],
    }
    print("| comparison | measured order | predicted order | reproduced |")
    print("|---|---|---|---|")
    by_name = {row.name: row for row in ROWS}
    for title, names in groups.items():
        measured = sorted(names, key=lambda n: -metric(by_name[n], measured=True))
        predicted = sorted(names, key=lambda n: -round(metric(by_name[n], measured=False), -12))
        ties = len({round(metric(by_name[n], measured=False), -12) for n in names}) < len(names)
        yes = "yes" if measured == predicted else "no" + (" (ties)" if ties else "")
        print(f"| {title} | {' > '.join(measured)} | {' > '.join(predicted)} | {yes} |")


def metric(row: Row, *, measured: bool) -> float:
    """tok/s per GPU, or for whole models of different sizes, kiln's MFU."""
    _, step = predict(row)
    tokens = row.tokens_per_sec if measured else step.tokens_per_sec
    return tokens * step.flops_per_token / row.gpus


def plan_wall_time() -> None:
    command = [
        str(ROOT / ".venv" / "bin" / "kiln"),
        "plan",
        "--model",
        "llama3_70b",
        "--gpus",
        "8192",
        "--gpu",
        "h200",
        "--gpus-per-node",
        "4",
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    torch_import = time.perf_counter() - start
    print(f"`kiln plan --model llama3_70b --gpus 8192 --gpu h200 --gpus-per-node 4`: {wall:.1f} s")
    print(f"(of which importing torch alone, in a fresh process: {torch_import:.1f} s)\n")
    print("```\n" + done.stdout.strip() + "\n```")


if __name__ == "__main__":
    print("### Memory per GPU\n")
    memory_table()
    print("\n### The reference's rows with its TP laid out without sequence or loss parallel\n")
    reference_without_sp_table()
    print("\n### Throughput\n")
    throughput_table()
    print("\n### Orderings\n")
    orderings()
    print("\n### Wall time\n")
    plan_wall_time()
