"""Checks of the qwen3_next family's keys: its layer types, the Gated DeltaNet table
(model.linear_attention), the gated, partly rotary full attention and the zero-centred norms,
and the layouts the family cannot run."""

from __future__ import annotations

from kiln.config.sections import JobConfig, ModelConfig

FAMILY = "qwen3_next"
# The [model] keys only this family computes; another family would ignore them.
_OPTIONS = ("attention_output_gate", "partial_rotary_factor", "norm_zero_centered")


def linear_attention_problems(cfg: JobConfig) -> list[str]:
    """Every problem of the qwen3_next family's keys and of the layout for it."""
    m = cfg.model
    if m.family != FAMILY:
        return _foreign_problems(m)
    return (
        _layer_type_problems(m) + _table_problems(m) + _rotary_problems(m) + _layout_problems(cfg)
    )


def _foreign_problems(m: ModelConfig) -> list[str]:
    p = []
    if "linear_attention" in m.layer_types:
        p.append(
            f"model.layer_types has linear_attention layers, which only family {FAMILY!r} "
            f"builds (Gated DeltaNet); set model.family = {FAMILY!r}, or list only "
            "full_attention and sliding_attention layers"
        )
    defaults = ModelConfig()
    changed = [k for k in _OPTIONS if getattr(m, k) != getattr(defaults, k)]
    if changed:
        p.append(
            f"model.{', model.'.join(changed)}: options of the {FAMILY} family's attention and "
            f"norms that family {m.family!r} does not compute; remove them, or set "
            f"model.family = {FAMILY!r}"
        )
    return p


def _layer_type_problems(m: ModelConfig) -> list[str]:
    types = m.layer_types
    if len(types) != m.n_layers:
        return [
            f"model.layer_types lists {len(types)} layers, model.n_layers is {m.n_layers}: "
            f"family {FAMILY!r} needs one type per layer, linear_attention or full_attention "
            '(Qwen3-Next: ["linear_attention", "linear_attention", "linear_attention", '
            '"full_attention"] repeated)'
        ]
    if "sliding_attention" in types:
        return [
            f"model.layer_types has sliding_attention layers; family {FAMILY!r} has no sliding "
            "window: use linear_attention or full_attention"
        ]
    return []


def _table_problems(m: ModelConfig) -> list[str]:
    a, p = m.linear_attention, []
    for name in (
        "num_key_heads",
        "num_value_heads",
        "key_head_dim",
        "value_head_dim",
        "conv_kernel",
        "chunk_size",
    ):
        if getattr(a, name) <= 0:
            p.append(f"model.linear_attention.{name} must be positive, got {getattr(a, name)}")
    if min(a.num_key_heads, a.num_value_heads) > 0 and a.num_value_heads % a.num_key_heads:
        p.append(
            f"model.linear_attention.num_value_heads ({a.num_value_heads}) must be a multiple "
            f"of num_key_heads ({a.num_key_heads}): each query/key head serves a whole group of "
            "value heads"
        )
    return p


def _rotary_problems(m: ModelConfig) -> list[str]:
    factor = m.partial_rotary_factor
    if not 0 < factor <= 1:
        return [
            f"model.partial_rotary_factor must be in (0, 1] (the share of each head's dims "
            f"RoPE turns; Qwen3-Next: 0.25), got {factor}"
        ]
    if m.n_heads > 0 and m.resolved_head_dim > 0 and (m.rotary_dim <= 0 or m.rotary_dim % 2):
        return [
            f"model.partial_rotary_factor ({factor}) of head_dim {m.resolved_head_dim} turns "
            f"{m.rotary_dim} dims; RoPE turns pairs: pick a factor that gives an even, "
            "positive width"
        ]
    return []


def _layout_problems(cfg: JobConfig) -> list[str]:
    d, a, p = cfg.distributed, cfg.model.linear_attention, []
    if d.tp > 1 and a.num_key_heads > 0 and a.num_key_heads % d.tp:
        valid = [t for t in range(1, a.num_key_heads + 1) if a.num_key_heads % t == 0]
        p.append(
            f"distributed.tp ({d.tp}) must divide model.linear_attention.num_key_heads "
            f"({a.num_key_heads}): each tp rank runs whole key heads with their value heads; "
            f"valid tp: {', '.join(map(str, valid))}"
        )
    if d.cp > 1:
        # Each chunk's convolution reads the conv_kernel − 1 inputs before it from the chunk
        # before (model/qwen3_next/context_parallel.py), never from two chunks back.
        halo = a.conv_kernel - 1
        lengths = [cfg.train.seq_len, *(phase.seq_len for phase in cfg.train.seq_len_schedule)]
        short = [n for n in lengths if n > 0 and n // (2 * d.cp) < halo]
        if short:
            p.append(
                f"distributed.cp = {d.cp} cuts a sequence of {min(short)} tokens into chunks of "
                f"{min(short) // (2 * d.cp)}, shorter than the {halo} inputs the Gated DeltaNet's "
                f"convolution reads before each chunk (model.linear_attention.conv_kernel − 1); "
                f"use sequences of at least {2 * d.cp * halo} tokens or a smaller cp"
            )
    return p
