"""`kiln plan`'s search: every layout the validator accepts for the GPUs (with context parallel,
each of its exchanges: all-gather, ring or all-to-all), every activation checkpointing mode and
micro-batch size; drop what does not fit, rank the rest by tokens/s.

A layout is a factorization of the GPU count into dp_replicate × dp_shard × cp × tp × pp × ep
(ep only for MoE models). Its validity is kiln's own validator's (kiln/config/validate.py), asked
once per layout, and again for the pipeline's micro-batch rules per batch. Memory only grows with
the micro-batch, so for each layout and mode the search stops at the first size that does not
fit; without a pipeline only the largest that fits is timed (it is the fastest).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field, replace
from typing import get_args

from kiln.config.sections import CpMode, JobConfig
from kiln.config.validate import collect_problems
from kiln.errors import ConfigError
from kiln.plan.hardware import Cluster
from kiln.plan.memory import MemoryEstimate, estimate_memory, fits
from kiln.plan.throughput import StepTime, data_ranks, step_time

AC_MODES = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
# Interleaved 1F1B with two stages per rank: the schedule with a smaller bubble that compile
# and every layer count the validator accepts allow; 1F1B otherwise.
PP_SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2))
# Context parallel's exchanges, the default first (docs/long_context.md).
CP_MODES: tuple[str, ...] = get_args(CpMode)


@dataclass(frozen=True)
class Candidate:
    cfg: JobConfig
    degrees: dict[str, int]
    memory: MemoryEstimate
    step: StepTime
    fits: bool

    @property
    def key(self) -> str:
        shown = {k: v for k, v in self.degrees.items() if v > 1} or {"single GPU": 1}
        key = " × ".join(f"{k}={v}" for k, v in shown.items())
        mode = self.cfg.distributed.cp_mode
        return key if self.degrees["cp"] == 1 else f"{key} ({mode.replace('_', '-')})"


@dataclass
class PlanResult:
    cluster: Cluster
    ranked: list[Candidate]  # fitting, fastest first
    considered: int  # layouts × modes × batches evaluated
    layouts: int  # layouts the validator accepted
    smallest_fit: Candidate | None = None  # for the message when nothing fits
    notes: list[str] = field(default_factory=list)


def distinct(ranked: list[Candidate], top: int) -> list[Candidate]:
    """The best `top` candidates that differ in more than how the data ranks split into
    replicas and shards (HSDP variants of one layout run at nearly the same speed)."""
    shown, seen = [], set()
    for candidate in ranked:
        d = candidate.degrees
        key = (
            d["tp"],
            d["pp"],
            d["cp"],
            d["ep"],
            candidate.cfg.train.activation_checkpointing,
            candidate.cfg.distributed.cp_mode,
        )
        if key not in seen:
            seen.add(key)
            shown.append(candidate)
        if len(shown) == top:
            break
    return shown


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(gpus: int, *, moe_experts: int = 0) -> list[dict[str, int]]:
    """Every dp_replicate × dp_shard × cp × tp × pp × ep = gpus (ep dividing the experts)."""
    out = []
    for tp in divisors(gpus):
        for pp in divisors(gpus // tp):
            for cp in divisors(gpus // (tp * pp)):
                rest = gpus // (tp * pp * cp)
                for ep in divisors(rest) if moe_experts else [1]:
                    if moe_experts and moe_experts % ep:
                        continue
                    for replicate in divisors(rest // ep):
                        shard = rest // (ep * replicate)
                        degrees = {"dp_replicate": replicate, "dp_shard": shard}
                        out.append({**degrees, "cp": cp, "tp": tp, "pp": pp, "ep": ep})
    return out


def layout_config(
    base: JobConfig,
    degrees: dict[str, int],
    schedule: tuple[str, int],
    cp_mode: CpMode = "all_gather",
) -> JobConfig:
    """`base` on `degrees` with a pipeline `schedule` (name, virtual stages) and context
    parallel's `cp_mode`; the sections the layout does not touch are shared with `base`, not
    copied."""
    name, virtual = schedule if degrees["pp"] > 1 else ("1f1b", 1)
    dist = replace(
        base.distributed,
        **degrees,
        cp_mode=cp_mode,
        pp_schedule=name,
        pp_virtual_stages=virtual,
        pp_microbatches=0,
        pp_layers_per_stage=[],
    )
    # Compile is refused with tensor parallel: off there.
    train = replace(base.train, compile=base.train.compile and degrees["tp"] == 1)
    return replace(base, distributed=dist, train=train)


def with_batch(layout: JobConfig, batch: tuple[int, int, int], mode: str) -> JobConfig:
    """`layout` with (batch_size, grad_accum_steps, pp_microbatches) and the AC `mode`."""
    cfg, train, dist = copy.copy(layout), copy.copy(layout.train), copy.copy(layout.distributed)
    train.batch_size, train.grad_accum_steps, dist.pp_microbatches = batch
    train.activation_checkpointing = mode
    cfg.train, cfg.distributed = train, dist
    return cfg


def batch_choices(
    cfg: JobConfig, degrees: dict[str, int], global_tokens: int | None
) -> list[tuple[int, int, int]]:
    """(batch_size, grad_accum_steps, pp_microbatches) to try, smallest micro-batch first. With a
    global batch, the sequences each data rank reads per step are fixed and split into
    micro-batches; without, each data rank reads one micro-batch (a pipeline pass of 2·pp)."""
    seq, ranks, pp = cfg.train.seq_len, data_ranks(degrees), degrees["pp"]
    if global_tokens is None:
        if pp > 1:
            return [(b * 2 * pp, 1, 2 * pp) for b in MICRO_BATCHES]
        return [(b, 1, 0) for b in MICRO_BATCHES]
    if global_tokens % (seq * ranks):
        return []
    per_rank = global_tokens // (seq * ranks)
    sizes = [b for b in MICRO_BATCHES if per_rank % b == 0]
    if pp > 1:
        # One pass per step: its micro-batches of b sequences, at least pp of them.
        return [(per_rank, 1, per_rank // b) for b in sizes if per_rank // b >= pp]
    return [(b, per_rank // b, 0) for b in sizes]


def evaluate(
    cfg: JobConfig, degrees: dict[str, int], cluster: Cluster, memory: MemoryEstimate | None = None
) -> Candidate:
    memory = memory or estimate_memory(cfg, degrees)
    step = step_time(cfg, degrees, cluster)
    return Candidate(cfg, degrees, memory, step, fits(memory, cluster.gpu.memory_bytes))


def search(
    base: JobConfig, cluster: Cluster, *, global_tokens: int | None = None, modes=AC_MODES
) -> PlanResult:
    """Rank every valid, fitting candidate for `base`'s model and training settings."""
    ranked, considered, layouts = [], 0, 0
    smallest: Candidate | None = None
    for degrees in factorizations(cluster.gpus, moe_experts=max(base.model.moe.num_experts, 0)):
        schedules = PP_SCHEDULES if degrees["pp"] > 1 else PP_SCHEDULES[:1]
        cp_modes = CP_MODES if degrees["cp"] > 1 else CP_MODES[:1]
        for schedule, cp_mode in itertools.product(schedules, cp_modes):
            layout = layout_config(base, degrees, schedule, cp_mode)
            if collect_problems(layout, cluster.gpus):
                continue
            layouts += 1
            batches = batch_choices(layout, degrees, global_tokens)
            if degrees["pp"] > 1:  # the pipeline's micro-batch rules
                batches = [
                    b
                    for b in batches
                    if not collect_problems(with_batch(layout, b, "full"), cluster.gpus)
                ]
            for mode in modes:
                fitting = []
                for batch in batches:
                    considered += 1
                    cfg = with_batch(layout, batch, mode)
                    memory = estimate_memory(cfg, degrees)
                    if not fits(memory, cluster.gpu.memory_bytes):
                        if smallest is None or memory.total < smallest.memory.total:
                            smallest = evaluate(cfg, degrees, cluster)
                        break  # a larger micro-batch needs more memory still
                    fitting.append((cfg, memory))
                # Without a pipeline a larger micro-batch is never slower (fewer transfers per
                # token): only the largest that fits is timed. A pipeline's bubble shrinks with
                # more, smaller micro-batches: each is timed.
                timed = fitting if degrees["pp"] > 1 else fitting[-1:]
                ranked += [evaluate(cfg, degrees, cluster, memory) for cfg, memory in timed]
    # Fastest first; among equals (to 0.1%) the lighter on memory.
    ranked.sort(key=lambda c: (-float(f"{c.step.tokens_per_sec:.3g}"), c.memory.total))
    return PlanResult(cluster, ranked, considered, layouts, smallest)


def no_layout_message(base: JobConfig, result: PlanResult, smallest_gpus: int | None) -> str:
    c = result.cluster
    what = base.model.preset or "the model"
    best = result.smallest_fit
    need = f" (the smallest needs {best.memory.total / 1e9:.0f} GB)" if best else ""
    hint = (
        f"; the smallest count of {c.gpu.name} that fits is {smallest_gpus} GPUs"
        if smallest_gpus
        else "; no count up to the largest tried fits: shorten seq_len or pick a larger GPU"
    )
    return (
        f"{what} fits no layout on {c.gpus} × {c.gpu.name} "
        f"({c.gpu.memory_bytes / 1e9:.0f} GB each){need}{hint}"
    )


def smallest_gpu_count(
    base: JobConfig, cluster: Cluster, *, global_tokens: int | None, limit: int = 1 << 16
) -> int | None:
    """The fewest GPUs (whole nodes, doubling) on which some layout fits, or None."""
    gpus = cluster.gpus * 2
    while gpus <= limit:
        trial = Cluster(cluster.gpu, gpus, cluster.gpus_per_node, cluster.network)
        if fits_anywhere(base, trial, global_tokens=global_tokens):
            return gpus
        gpus *= 2
    return None


def fits_anywhere(base: JobConfig, cluster: Cluster, *, global_tokens: int | None) -> bool:
    """Whether the leanest settings (full AC, the smallest micro-batch) fit some layout."""
    result = search(base, cluster, global_tokens=global_tokens, modes=("full",))
    return bool(result.ranked)


def require_fit(base: JobConfig, result: PlanResult, *, global_tokens: int | None) -> None:
    if result.ranked:
        return
    if global_tokens is not None and not result.considered:
        raise ConfigError(
            f"--global-batch-tokens {global_tokens:,} splits over no layout of "
            f"{result.cluster.gpus} GPUs: it must be seq_len ({base.train.seq_len}) × a multiple "
            "of the data-parallel ranks; use a multiple of "
            f"{base.train.seq_len * result.cluster.gpus:,} tokens"
        )
    smallest = smallest_gpu_count(base, result.cluster, global_tokens=global_tokens)
    raise ConfigError(no_layout_message(base, result, smallest))
