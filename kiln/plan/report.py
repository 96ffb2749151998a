"""What `kiln plan` and `kiln check --gpu` print: a table of the best layouts, the winner's reason,
JSON, and the winner written as a recipe."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.config import JobConfig
from kiln.config.dump import write_config
from kiln.plan.hardware import Cluster
from kiln.plan.memory import CONTEXT_BYTES, estimate_memory, fits
from kiln.plan.search import Candidate, PlanResult, distinct, evaluate
from kiln.plan.throughput import data_ranks

GB = 1e9


def candidate_dict(c: Candidate) -> dict:
    """One candidate as JSON: its layout, batch, memory by term and step by collective."""
    t = c.cfg.train
    return {
        "layout": c.degrees,
        "pp_schedule": c.cfg.distributed.pp_schedule if c.degrees["pp"] > 1 else None,
        "activation_checkpointing": t.activation_checkpointing,
        "batch_size": t.batch_size,
        "grad_accum_steps": t.grad_accum_steps,
        "global_batch_tokens": int(c.step.tokens),
        "memory_gb": round(c.memory.total / GB, 2),
        "memory_reserved_gb": round(c.memory.reserved / GB, 2),
        "memory_terms_gb": {k: round(v / GB, 3) for k, v in c.memory.terms().items()},
        "fits": c.fits,
        "tokens_per_sec": round(c.step.tokens_per_sec, 1),
        "tokens_per_sec_per_gpu": round(c.step.tokens_per_sec / c.step.gpus, 1),
        "mfu": round(c.step.mfu, 4),
        "step_seconds": round(c.step.seconds, 4),
        "compute_seconds": round(c.step.compute, 4),
        "bubble_seconds": round(c.step.bubble, 4),
        "comm_seconds": {k: round(v, 4) for k, v in c.step.comm.items()},
        "exposed_comm_seconds": round(c.step.exposed, 4),
    }


def batch_label(c: Candidate) -> str:
    """Sequences per micro-batch, and the micro-batches a step runs: accumulated, or a
    pipeline pass's."""
    t, d = c.cfg.train, c.cfg.distributed
    if c.degrees["pp"] > 1:
        micro = d.pp_microbatches or t.batch_size
        return f"{micro} × {t.batch_size // micro} seq, {d.pp_schedule}"
    return f"{t.batch_size} seq" + (
        f" × {t.grad_accum_steps} accum" if t.grad_accum_steps > 1 else ""
    )


def biggest(terms: dict[str, float]) -> str:
    return max(terms, key=terms.get) if terms else "none"


def why(result: PlanResult) -> str:
    """The winner's reason: what its step is made of, and what costs the runner-up its place."""
    best = result.ranked[0]
    s, memory = best.step, best.memory
    capacity = result.cluster.gpu.memory_bytes
    hidden = sum(v for k, v in s.comm.items() if k.startswith(("fsdp", "hsdp")))
    overlaps = [f"FSDP's {hidden:.2f} s overlaps the compute"] if hidden else []
    if best.degrees["cp"] > 1 and best.cfg.distributed.cp_mode == "ring":
        overlaps.append(
            f"the ring's {s.comm['cp']:.2f} s its attention, all but what a send outlasts"
        )
    parts = [
        f"{best.key} with AC {best.cfg.train.activation_checkpointing!r} is the fastest layout "
        f"that fits ({memory.total / GB:.1f} GB of {capacity / GB:.0f}, largest term "
        f"{biggest(memory.terms())}): a step is {s.compute:.2f} s of compute"
        + (f" + {s.bubble:.2f} s pipeline bubble" if s.bubble else "")
        + f" + {s.exposed:.2f} s of communication left exposed"
        + (f" ({'; '.join(overlaps)})" if overlaps else "")
    ]
    if len(distinct(result.ranked, 2)) > 1:
        other = distinct(result.ranked, 2)[-1]
        loss = 1 - other.step.tokens_per_sec / s.tokens_per_sec
        extra = {
            "compute": other.step.compute - s.compute,
            "bubble": other.step.bubble - s.bubble,
            "communication": other.step.exposed - s.exposed,
        }
        cost = max(extra, key=extra.get)
        parts.append(
            f"the next layout, {other.key} (AC {other.cfg.train.activation_checkpointing!r}), "
            f"is {loss:.0%} slower, mostly in {cost}"
            + (f" ({biggest(other.step.comm)})" if cost == "communication" else "")
        )
    return "; ".join(parts)


# The plan table's columns: header and alignment ("<" text, ">" numbers).
PLAN_COLUMNS = [
    ("#", ">"),
    ("layout", "<"),
    ("AC", "<"),
    ("batch", "<"),
    ("global tok", ">"),
    ("GB/GPU", ">"),
    ("tok/s", ">"),
    ("tok/s/GPU", ">"),
    ("MFU", ">"),
]


def table(columns: list[tuple[str, str]], rows: list[list[str]]) -> list[str]:
    """Header and rows, each column as wide as its widest cell: a long cell (a pipeline
    schedule's batch) widens its column instead of pushing the rest of its row out of line."""
    header = [name for name, _ in columns]
    cells = [header, *rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    aligns = [align for _, align in columns]
    return [
        "  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, aligns, widths, strict=True)).rstrip()
        for row in cells
    ]


def text_report(result: PlanResult, base: JobConfig, *, top: int) -> str:
    c = result.cluster
    model = base.model.preset or "the model"
    lines = [
        f"kiln plan: {model} on {c.gpus} × {c.gpu.name} ({c.gpus_per_node} per node, "
        f"{c.network.name} between nodes), seq_len {base.train.seq_len}",
        f"{result.layouts:,} layouts the validator accepts, {result.considered:,} candidates "
        f"(AC modes × micro-batches), {len(result.ranked):,} fit",
        "",
    ]
    rows = [
        [
            str(i),
            cand.key,
            cand.cfg.train.activation_checkpointing,
            batch_label(cand),
            f"{cand.step.tokens:,.0f}",
            f"{cand.memory.total / GB:.1f}",
            f"{cand.step.tokens_per_sec:,.0f}",
            f"{cand.step.tokens_per_sec / cand.step.gpus:,.0f}",
            f"{cand.step.mfu:.1%}",
        ]
        for i, cand in enumerate(distinct(result.ranked, top), 1)
    ]
    lines += table(PLAN_COLUMNS, rows)
    lines += ["", f"why #1: {why(result)}"]
    return "\n".join(lines)


def json_report(result: PlanResult, base: JobConfig, *, top: int, extra: dict | None = None) -> str:
    """The plan as JSON; `extra` adds top-level keys (`--fault-tolerance`'s)."""
    c = result.cluster
    out = {
        "model": base.model.preset or None,
        "gpus": c.gpus,
        "gpu": c.gpu.name,
        "gpus_per_node": c.gpus_per_node,
        "network": c.network.name,
        "seq_len": base.train.seq_len,
        "layouts": result.layouts,
        "candidates": result.considered,
        "fitting": len(result.ranked),
        "top": [candidate_dict(cand) for cand in distinct(result.ranked, top)],
        "why": why(result),
        **(extra or {}),
    }
    return json.dumps(out, indent=2)


def write_recipe(candidate: Candidate, path: Path, *, command: str) -> None:
    """The candidate's whole config as a recipe `kiln check` and `kiln train` read back."""
    write_config(candidate.cfg, path)
    header = (
        f"# Written by `{command}`: {candidate.key}, predicted "
        f"{candidate.memory.total / GB:.1f} GB/GPU, {candidate.step.tokens_per_sec:,.0f} tok/s, "
        f"MFU {candidate.step.mfu:.1%} (docs/scaling.md says how far to trust it).\n"
    )
    path.write_text(header + path.read_text())


def check_estimate(cfg: JobConfig, degrees: dict[str, int], cluster: Cluster | None) -> dict:
    """`kiln check`'s estimate for one recipe: memory always, speed with a GPU named."""
    memory = estimate_memory(cfg, degrees)
    out = {
        "layout": degrees,
        "data_ranks": data_ranks(degrees),
        "memory_gb": round(memory.total / GB, 2),
        "memory_reserved_gb": round(memory.reserved / GB, 2),
        "memory_terms_gb": {k: round(v / GB, 3) for k, v in memory.terms().items()},
        "tokens_per_sec": None,
        "mfu": None,
    }
    if cluster is not None:
        candidate = evaluate(cfg, degrees, cluster)
        out.update({k: v for k, v in candidate_dict(candidate).items() if k not in ("layout",)})
        out["gpu"] = cluster.gpu.name
        out["fits"] = fits(memory, cluster.gpu.memory_bytes)
    return out


def check_lines(estimate: dict, cluster: Cluster | None) -> list[str]:
    """The estimate as `kiln check`'s comment lines."""
    terms = ", ".join(f"{k} {v:.1f}" for k, v in estimate["memory_terms_gb"].items() if v)
    lines = [f"planner memory per GPU: {estimate['memory_gb']:.1f} GB ({terms})"]
    if cluster is not None:
        fit = "fits" if estimate["fits"] else "does NOT fit"
        room = (cluster.gpu.memory_bytes - CONTEXT_BYTES) / GB
        comm = ", ".join(f"{k} {v:.2f} s" for k, v in estimate["comm_seconds"].items())
        lines += [
            f"on {cluster.gpu.name}: {fit} (~{estimate['memory_reserved_gb']:.1f} GB reserved "
            f"of {room:.0f} GB usable)",
            f"predicted {estimate['tokens_per_sec']:,.0f} tok/s, MFU {estimate['mfu']:.1%}; step "
            f"{estimate['step_seconds']:.2f} s = compute {estimate['compute_seconds']:.2f} s"
            f" + bubble {estimate['bubble_seconds']:.2f} s + exposed communication "
            f"{estimate['exposed_comm_seconds']:.2f} s ({comm or 'none'})",
        ]
    return lines
