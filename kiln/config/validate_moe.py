"""Checks of the Mixture-of-Experts keys of [model.moe], which `validate.py` adds to its model checks,
and of expert parallel (`distributed.ep`), which it adds to its layout checks."""

from __future__ import annotations

import tomllib

from kiln.config.load import MODEL_PRESET_DIR, move_moe_keys
from kiln.config.sections import JobConfig, ModelConfig, MoEConfig

# Keys that only mean something in an MoE model, with their dense (off) value.
MOE_ONLY = {
    "shared_experts": 0,
    "shared_expert_gate": False,
    "aux_loss_weight": 0.0,
    "seq_aux_loss_weight": 0.0,
    "router_z_loss_weight": 0.0,
    "bias_update_rate": 0.0,
}
NON_NEGATIVE = (
    "num_experts",
    "ffn_hidden_dim",
    "shared_experts",
    "first_dense_layers",
    "aux_loss_weight",
    "seq_aux_loss_weight",
    "router_z_loss_weight",
    "bias_update_rate",
    "capacity_factor",
)


def moe_problems(cfg: JobConfig) -> list[str]:
    """Every problem with the MoE keys; none for a dense model that leaves them alone."""
    m = cfg.model
    p = [
        f"model.moe.{name} must be >= 0, got {getattr(m.moe, name)}"
        for name in NON_NEGATIVE
        if getattr(m.moe, name) < 0
    ]
    if m.moe.num_experts <= 0:
        return p + _dense_problems(m.moe)
    # Every layout kiln builds trains MoE (tests/distributed/test_moe_parity.py): no layout
    # problem of its own but distributed.ep's (below). Under tensor parallel each tp rank routes
    # its part of the sequence.
    return p + _routing_problems(m.moe) + _layer_problems(m)


def expert_parallel_problems(cfg: JobConfig) -> list[str]:
    """`distributed.ep > 1` splits every MoE block's experts evenly over the ep ranks: the model
    must have experts, and as many on each rank."""
    ep, m = cfg.distributed.ep, cfg.model.moe
    if ep <= 1 or m.num_experts < 0:  # ep < 1 and num_experts < 0 are reported on their own
        return []
    if m.num_experts == 0:
        name = cfg.model.preset
        preset = f"model.preset = {name!r}" if name else "no model.preset"
        return [
            f"distributed.ep = {ep} (expert parallel) splits the experts of a Mixture-of-Experts "
            f"model over {ep} ranks, but this model is dense (model.moe.num_experts = 0, {preset}): "
            f"set distributed.ep = 1, or pick an MoE preset ({', '.join(moe_presets())})"
        ]
    if m.num_experts % ep:
        divisors = [k for k in range(1, m.num_experts + 1) if m.num_experts % k == 0]
        below = max(k for k in divisors if k < ep)
        above = [k for k in divisors if k > ep]
        nearest = f"{below} or {above[0]}" if above else str(below)
        return [
            f"distributed.ep = {ep} must divide model.moe.num_experts = {m.num_experts} (each ep "
            f"rank holds the same number of experts); choose distributed.ep from "
            f"{', '.join(map(str, divisors))} (nearest: {nearest})"
        ]
    return []


def moe_presets() -> list[str]:
    """The shipped model presets that have experts."""
    found = []
    for path in sorted(MODEL_PRESET_DIR.glob("*.toml")):
        try:
            with path.open("rb") as f:
                preset = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError):
            continue
        move_moe_keys(preset, "", [])
        moe = preset.get("moe")
        experts = moe.get("num_experts", 0) if isinstance(moe, dict) else 0
        if isinstance(experts, int) and experts > 0:
            found.append(path.stem)
    return found


def _dense_problems(m: MoEConfig) -> list[str]:
    return [
        f"model.moe.{name} = {_toml(getattr(m, name))} needs a Mixture-of-Experts model, but "
        f"model.moe.num_experts = {m.num_experts} (dense): set num_experts > 0 or leave {name} out"
        for name, off in MOE_ONLY.items()
        if getattr(m, name) != off
    ]


def _routing_problems(m: MoEConfig) -> list[str]:
    p = []
    if not 1 <= m.top_k <= m.num_experts:
        p.append(
            f"model.moe.top_k = {m.top_k} must be in [1, model.moe.num_experts = "
            f"{m.num_experts}]: a token cannot use more experts than there are"
        )
    if m.route_scale <= 0:
        p.append(f"model.moe.route_scale must be positive, got {m.route_scale}")
    if m.shared_expert_gate and m.shared_experts == 0:
        p.append(
            "model.moe.shared_expert_gate = true gates the shared experts, but "
            "model.moe.shared_experts = 0: set shared_experts > 0 or the gate to false"
        )
    return p + _group_problems(m)


def _group_problems(m: MoEConfig) -> list[str]:
    """Group-limited routing: at most one problem, the first that makes the next meaningless."""
    if m.n_groups < 1 or m.topk_groups < 1:
        return [
            f"model.moe.n_groups and model.moe.topk_groups must be >= 1 (1: no group limit), "
            f"got {m.n_groups} and {m.topk_groups}"
        ]
    if m.num_experts % m.n_groups:
        divisors = [g for g in range(1, m.num_experts + 1) if m.num_experts % g == 0]
        return [
            f"model.moe.n_groups = {m.n_groups} must divide model.moe.num_experts = "
            f"{m.num_experts} into equal groups; use one of {divisors}"
        ]
    if m.topk_groups > m.n_groups:
        return [
            f"model.moe.topk_groups = {m.topk_groups} exceeds model.moe.n_groups = "
            f"{m.n_groups}: tokens cannot use more groups than there are; lower topk_groups"
        ]
    per_group = m.num_experts // m.n_groups
    # top_k > num_experts is reported on its own.
    if m.num_experts >= m.top_k > m.topk_groups * per_group:
        return [
            f"model.moe.top_k = {m.top_k} exceeds the {m.topk_groups * per_group} experts "
            f"a token can reach (topk_groups × experts per group = {m.topk_groups} × "
            f"{per_group}); raise topk_groups or lower top_k"
        ]
    return []


def _layer_problems(m: ModelConfig) -> list[str]:
    moe = m.moe
    if moe.frequency <= 0:
        return [
            f"model.moe.frequency must be >= 1 (every k-th block after the first dense ones is "
            f"MoE), got {moe.frequency}"
        ]
    if m.n_layers > 0 and moe.first_dense_layers >= m.n_layers:
        return [
            f"model.moe.first_dense_layers = {moe.first_dense_layers} leaves no MoE block among "
            f"model.n_layers = {m.n_layers}: lower it below n_layers, or set num_experts = 0 for "
            "a dense model"
        ]
    return []


def _toml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)
