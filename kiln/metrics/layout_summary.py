"""Lines `kiln check` prints about a layout's context parallel and FP8, from the config alone
(the model is built on the meta device: nothing is allocated)."""

from __future__ import annotations

from collections import Counter

from kiln.config.sections import JobConfig
from kiln.model import build_model
from kiln.model.registry import family_of
from kiln.parallel.float8 import float8_layer_plan
from kiln.plan import model_facts
from kiln.plan.activations import (
    cp_exchange_bytes,
    cp_held_bytes,
    cp_transient_bytes,
    gathered_kv_bytes,
    own_kv_bytes,
)
from kiln.plan.throughput import recompute_factor, ring_recompute_flops


def float8_summary(cfg: JobConfig, layout: dict[str, int]) -> str:
    """Which linear layers compute in float8, and what stays in high precision and why."""
    model = build_model(cfg.model)
    excluded = family_of(cfg.model).parallel_plan(cfg.model).float8_excluded
    plan = float8_layer_plan(model, cfg, tp=layout["tp"], excluded=excluded)
    # One line per reason, not per layer: "router" keeps one gate per MoE layer.
    kept = Counter(reason for reason in plan.values() if reason is not None)
    high = cfg.fp8.high_precision
    experts = (
        f"; the routed experts compute in {high} (grouped GEMMs, which torchao's float8 training "
        "does not cover here)"
        if cfg.model.moe.num_experts > 0
        else ""
    )
    reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(kept.items())) or "none"
    gathers = ""
    if layout["tp"] > 1:
        precision = "float8" if cfg.fp8.recipe == "tensorwise" else high
        gathers = f"; tensor parallel gathers their inputs in {precision}"
    return (
        f"{sum(r is None for r in plan.values())} of {len(plan)} linear layers in float8 "
        f"({cfg.fp8.recipe}), the rest in {high}: {reasons}{experts}{gathers}; MFU is against the "
        "bf16 peak"
    )


def context_parallel_summary(cfg: JobConfig, layout: dict[str, int]) -> str:
    """How context parallel splits each sequence and what its exchange moves and keeps."""
    cp, seq_len = layout["cp"], cfg.train.seq_len
    split = (
        f"each rank holds {seq_len // cp:,} of every {seq_len:,} tokens (chunks "
        f"{seq_len // (2 * cp):,} long, head-tail); per layer and micro-batch it "
    )
    sent = cp_exchange_bytes(cfg, layout) / 2**20
    if cfg.distributed.cp_mode == "all_to_all":
        return split + (
            f"sends {sent:,.1f} MiB in all-to-alls (queries, keys and values to 1/cp of the "
            f"heads over the whole sequence, the output back; as much again in backward) and "
            f"keeps one more copy of its own tokens' output "
            f"({cp_held_bytes(cfg, layout) / 2**20:,.1f} MiB), over the heads for attention and "
            f"over the sequence for the output projection"
        )
    if cfg.distributed.cp_mode == "ring":
        return split + _ring(cfg, layout)
    gathered = gathered_kv_bytes(cfg, layout)
    kept = (
        "a checkpointed layer gathers them again when it is recomputed"
        if cfg.train.activation_checkpointing == "full"
        else "a layer not checkpointed keeps them for its backward"
    )
    return split + (
        f"all-gathers {sent:,.1f} MiB of keys and values, the whole sequence's "
        f"{gathered / 2**20:,.1f} MiB (reduce-scattered back in backward); {kept}"
    )


def _ring(cfg: JobConfig, layout: dict[str, int]) -> str:
    """What the ring sends and holds per layer and micro-batch, and what its backward redoes."""
    mib = 2**20
    block, sent = own_kv_bytes(cfg, layout) / mib, cp_exchange_bytes(cfg, layout) / mib
    backward = cp_exchange_bytes(cfg, layout, backward=True) / mib
    model_flops = model_facts.flops(cfg.model, cfg.train.seq_len) * recompute_factor(cfg, layout)
    more = ring_recompute_flops(cfg, layout) / model_flops
    return (
        f"passes the keys and values around the ring: {layout['cp'] - 1} sends of a "
        f"{block:,.1f} MiB block ({sent:,.1f} MiB), each overlapped with the attention of the "
        f"block in hand, and {backward:,.1f} MiB in backward (the blocks again and each block's "
        f"fp32 gradient); it keeps nothing of the other ranks' keys and values, only one more "
        f"copy of its own tokens' output ({cp_held_bytes(cfg, layout) / mib:,.1f} MiB, over the "
        f"heads as it returns it), and holds 2 blocks in "
        f"forward, {cp_transient_bytes(cfg, layout) / mib:,.1f} MiB in backward with their "
        f"gradients; the backward recomputes each block's attention forward (one attention "
        f"forward more per layer than the all-gather: {more:.0%} more FLOPs here)"
    )
