"""docs/scaling.md, written by the planner wherever it states a number, so the guide cannot drift
from the model (tests/unit/test_plan_guide.py fails when it does). Regenerate with

    .venv/bin/python -m kiln.plan.guide > docs/scaling.md
"""

from __future__ import annotations

from kiln.config import config_from_dict
from kiln.plan.fault_tolerance import (
    LLAMA3_FAILURES_PER_GPU_HOUR,
    QUORUM_MS,
    RESTART_S,
    STALL_S,
    SYNC_EVERY,
)
from kiln.plan.hardware import (
    COMPUTE_EFFICIENCY,
    NETWORK_EFFICIENCY,
    NVLINK_EFFICIENCY,
    find_gpu,
    make_cluster,
)
from kiln.plan.memory import ALLOCATOR_OVERHEAD, CONTEXT_BYTES, estimate_memory
from kiln.plan.report import batch_label
from kiln.plan.search import distinct, search
from kiln.plan.throughput import step_time

GB = 1e9
BATCH = 1 << 20  # tokens per step in the guide's examples
PICKS = (("llama3_7b", 4), ("llama3_7b", 8), ("llama3_13b", 32), ("llama3_70b", 32))
ONE = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}


def _cluster(gpus: int):
    return make_cluster(find_gpu("h200"), gpus, 4)


def _recipe(preset: str, layout: dict, batch: int, ac: str = "full"):
    raw = {
        "model": {"preset": preset},
        "train": {"seq_len": 4096, "batch_size": batch, "activation_checkpointing": ac},
        "distributed": layout,
    }
    return config_from_dict(raw), {**ONE, **layout}


def picks_table() -> list[str]:
    lines = [
        "| model | GPUs | planner's pick | AC | micro-batches | GB/GPU | tok/s | MFU | runner-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for preset, gpus in PICKS:
        base = config_from_dict({"model": {"preset": preset}, "train": {"seq_len": 4096}})
        best, *rest = distinct(search(base, _cluster(gpus), global_tokens=BATCH).ranked, 2)
        s, other = best.step, rest[0] if rest else None
        runner = "-"
        if other:
            slower = max(0.0, 1 - other.step.tokens_per_sec / s.tokens_per_sec)
            runner = f"{other.key}, {slower:.0%} slower"
        lines.append(
            f"| {preset} | {gpus} | {best.key} | {best.cfg.train.activation_checkpointing} | "
            f"{batch_label(best)} | {best.memory.total / GB:.1f} | {s.tokens_per_sec:,.0f} | "
            f"{s.mfu:.1%} | {runner} |"
        )
    return lines


def terms_table() -> list[str]:
    lines = [
        "| model, 32 H200, tp=4 × dp_shard=8, full AC | micro-batch | "
        "weights + grads + optimizer | activations | logits | gathered | total GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for preset, batch in (("llama3_7b", 4), ("llama3_13b", 4), ("llama3_70b", 2)):
        cfg, degrees = _recipe(preset, {"tp": 4, "dp_shard": 8}, batch)
        m = estimate_memory(cfg, degrees)
        lines.append(
            f"| {preset} | {batch} | {m.model_state / GB:.1f} | {m.activations / GB:.1f} | "
            f"{m.logits / GB:.1f} | {m.gathered / GB:.1f} | {m.total / GB:.1f} |"
        )
    return lines


def checkpointing_table() -> list[str]:
    lines = [
        "| llama3_13b, 32 H200, tp=4 × dp_shard=8, micro-batch 4 | GB/GPU | tok/s | MFU |",
        "|---|---|---|---|",
    ]
    for ac in ("none", "selective", "full"):
        cfg, degrees = _recipe("llama3_13b", {"tp": 4, "dp_shard": 8}, 4, ac)
        m, s = estimate_memory(cfg, degrees), step_time(cfg, degrees, _cluster(32))
        lines.append(f"| AC {ac} | {m.total / GB:.1f} | {s.tokens_per_sec:,.0f} | {s.mfu:.1%} |")
    return lines


def dimensions_table() -> list[str]:
    """What each dim costs for llama3_13b on 32 H200s: seconds of each collective per step."""
    lines = [
        "| llama3_13b on 32 H200 (micro-batch 4, full AC) | compute s | communication per step (s) | "
        "exposed s | tok/s |",
        "|---|---|---|---|---|",
    ]
    layouts = (
        {"dp_shard": 32},
        {"tp": 4, "dp_shard": 8},
        {"tp": 4, "pp": 2, "dp_shard": 4},
        {"cp": 2, "dp_shard": 16},
        {"dp_replicate": 8, "dp_shard": 4},
    )
    for layout in layouts:
        cfg, degrees = _recipe("llama3_13b", layout, 8 if "pp" in layout else 4)
        s = step_time(cfg, degrees, _cluster(32))
        comm = ", ".join(f"{k} {v:.2f}" for k, v in s.comm.items())
        name = " × ".join(f"{k}={v}" for k, v in layout.items())
        lines.append(
            f"| {name} | {s.compute:.2f} | {comm} | {s.exposed:.2f} | {s.tokens_per_sec:,.0f} |"
        )
    return lines


def fault_tolerance_section() -> list[str]:
    """`kiln plan --fault-tolerance` and its options, with their defaults from the model."""
    return [
        "`kiln plan --fault-tolerance` adds, for the layout it picks, what replica groups (its",
        "dp_replicate groups under `[fault_tolerance]`, [fault_tolerance.md](fault_tolerance.md))",
        "cost and save: the time they add to each step with every-step sync and with DiLoCo at H",
        "inner steps, the GPU-hours lost a day to failures with checkpoint restarts and with",
        "replica groups, and the GPU count above which replica groups lose less. `--json` puts",
        "it under `fault_tolerance`: each mode's cost as a fraction of the step under `every_step`",
        "and `diloco`, `break_even_gpus` per mode. A layout with dp_replicate = 1 has no replica",
        "groups, and the command says so. The model, its terms and a worked example are in",
        '[fault_tolerance.md](fault_tolerance.md), "When replica groups pay". Its inputs:',
        "",
        "| option | what | default |",
        "|---|---|---|",
        f"| `--failure-rate` | failures per GPU-hour | {LLAMA3_FAILURES_PER_GPU_HOUR:g} (The Llama 3 "
        "Herd of Models, 2024, section 3.3.4: 419 unexpected interruptions in 54 days on 16,384 "
        "H100s) |",
        "| `--restart-s` | with checkpoint restarts, seconds from a failure to training again | "
        f"{RESTART_S:g} |",
        "| `--checkpoint-interval` | steps between checkpoints | the recipe's "
        "`checkpoint.interval` |",
        "| `--group-restart-s` | with replica groups, seconds from a failure to the failed group "
        "training again | `--restart-s` |",
        f"| `--stall-s` | seconds the surviving groups stall per failure | {STALL_S:g} |",
        "| `--quorum-ms` | fixed time replica groups add to a step besides the gradient sum "
        f"(quorum, commit vote, small sums) | {QUORUM_MS:g} |",
        f"| `--sync-every` | DiLoCo's inner steps between syncs | {SYNC_EVERY} (Streaming DiLoCo's; "
        "DiLoCo ran 500) |",
    ]


def render() -> str:
    parts = [
        "# Scaling guide",
        "",
        "<!-- Generated by `python -m kiln.plan.guide > docs/scaling.md`; every number on this "
        "page is the planner's (kiln/plan/). tests/unit/test_plan_guide.py fails when it drifts. "
        "-->",
        "",
        "Which layout, which batch, will it fit, how fast: `kiln plan` answers before a GPU hour",
        "is spent, from a model whose every term is a named function in `kiln/plan/` with a unit",
        "test, and whose error against published runs is in",
        "[benchmarks/planner.md](../benchmarks/planner.md). The numbers below are the model's",
        "for H200s, 4 to a node, InfiniBand NDR between nodes, seq_len 4096, bf16, AdamW.",
        "",
        "```bash",
        "kiln plan --model llama3_70b --gpus 32 --gpu h200 --gpus-per-node 4 \\",
        f"    --global-batch-tokens {BATCH} --write configs/train/my_70b.toml",
        "kiln check configs/train/my_70b.toml --world-size 32 --gpu h200 --gpus-per-node 4",
        "```",
        "",
        "`kiln plan` tries every factorization of the GPUs into dp_replicate × dp_shard × cp × tp",
        "× pp (× ep for MoE) that kiln's validator accepts, each activation-checkpointing mode and",
        "micro-batch size, drops what does not fit and ranks the rest by predicted tok/s. `--json`",
        "prints every term; `kiln check --gpu` prints the same estimate for one recipe.",
        "",
        f"## What the planner picks ({BATCH:,} tokens per step)",
        "",
        *picks_table(),
        "",
        "The model prefers layouts that keep communication off the critical path: FSDP's",
        "transfers hide behind compute, tensor parallel's do not, and a pipeline costs its bubble.",
        "It knows nothing of kernel launch overheads or allocator fragmentation, and its pipeline",
        "and context-parallel throughput is untested against measurements: treat a pick with pp or",
        "cp as a candidate to measure, and compare it with the runner-up in one short run each.",
        "",
        "## What each dimension costs",
        "",
        *dimensions_table(),
        "",
        "- **FSDP** (dp_shard) shards weights, gradients and optimizer state. Each micro-batch it",
        "  all-gathers bf16 weights in forward and again in backward and reduce-scatters fp32",
        "  gradients; prefetching hides that behind compute until the network is the slower.",
        "- **TP** splits attention and the feed-forward; sequence parallel's all-gather and",
        "  reduce-scatter run four times a layer per pass and wait for each other. Keep it in a",
        "  node: across nodes it runs at the network's rate.",
        "- **PP** splits the layers; it sends little but idles for its schedule's bubble and",
        "  keeps up to pp micro-batches of activations in flight on the first stage.",
        "- **CP** splits the sequence; each layer gathers the keys and values of the rest of it",
        "  and waits for them, re-splits its queries, keys and values over the heads, or passes",
        "  the keys and values around a ring behind each block's attention and recomputes that",
        "  attention in its backward (`distributed.cp_mode`; the planner tries each).",
        "- **HSDP** (dp_replicate) all-reduces across replicas instead of sharding over them:",
        "  less traffic on the slow links, more memory per GPU.",
        "- **EP** (MoE) splits the experts and sends every routed token there and back.",
        "",
        "## Where the memory goes",
        "",
        *terms_table(),
        "",
        "Model state is fp32 weights and gradients and AdamW's two moments, 16 bytes per",
        "parameter, divided over every dim that shards it. Activations are what the blocks keep",
        "for backward (under full AC only each block's input, plus the block being recomputed),",
        "each block counted by its own token mixer: attention, or a hybrid's linear-attention layer",
        "(the qwen3_next family's Gated DeltaNet keeps about three times a full layer's,",
        "docs/models.md).",
        "The logits at the loss: 12 bytes per token and vocabulary entry (fp32 with their",
        "gradients), 4 when `train.compile` fuses the loss (bf16 logits and their gradient, tp=1),",
        'split by tp (loss parallel); `train.loss = "chunked_cross_entropy"` holds one chunk.',
        "Gathered is FSDP's unsharded units in flight and the root unit (embeddings and head).",
        "",
        "## Activation checkpointing",
        "",
        *checkpointing_table(),
        "",
        "kiln's `selective` checkpoints every other block: half the recompute of `full`, half its",
        "savings. Pick the lightest mode that fits; the planner does.",
        "",
        "## Should replica groups be on?",
        "",
        *fault_tolerance_section(),
        "",
        "## How far to trust an estimate, and how to correct it",
        "",
        f"Two constants are fitted, one published run each: the compute efficiency "
        f"({COMPUTE_EFFICIENCY:.0%} of the",
        f"dense peak) and what tensor parallel's collectives reach of NVLink ({NVLINK_EFFICIENCY:.0%});",
        f"the network is assumed to deliver {NETWORK_EFFICIENCY:.0%} of its line rate. A layout fits",
        f"when the estimate plus {ALLOCATOR_OVERHEAD:.0%} allocator overhead plus "
        f"{CONTEXT_BYTES / GB:.0f} GB of CUDA context",
        "is within the GPU's memory. [benchmarks/planner.md](../benchmarks/planner.md) lists the",
        "error of every term against published runs and which term is wrong where it misses.",
        "",
        "To check an estimate on your hardware, run the recipe for a few steps and compare:",
        "",
        "```bash",
        "kiln check RECIPE --world-size N --gpu h200 --gpus-per-node 4 --json   # memory_gb, tokens_per_sec",
        "kiln train RECIPE --train.max_steps=20                                  # under torchrun/srun",
        "```",
        "",
        "`peak_mem_gb` in the run's `metrics.jsonl` is the allocator's peak, the quantity",
        "`memory_gb` predicts. If they differ, run a second short job with another",
        "`train.batch_size`: the change in peak memory over the change in tokens is the",
        "activation and logit bytes per token, the rest is model state and gathered weights,",
        "and that tells which term to distrust. Likewise `tok/s` against `tokens_per_sec`:",
        "a single-node FSDP run checks the compute efficiency, a two-node one the network.",
        "",
    ]
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
