"""Checks of the DeepSeek-V3 family's keys: multi-head latent attention, multi-token prediction
and YaRN rotary scaling (model.mla, model.mtp, model.rope_yarn_*)."""

from __future__ import annotations

from kiln.config.sections import JobConfig, ModelConfig


def deepseek_problems(cfg: JobConfig) -> list[str]:
    """Every problem with the family-specific keys of `cfg.model` and their layout."""
    m = cfg.model
    problems = _yarn_problems(m)
    if m.family != "deepseek_v3":
        if m.mtp.depth:
            problems.append(
                f"model.mtp.depth = {m.mtp.depth}: multi-token prediction belongs to family "
                f"'deepseek_v3', not {m.family!r}; set model.mtp.depth = 0"
            )
        return problems
    return problems + _mla_problems(m) + _mtp_problems(m)


def _mla_problems(m: ModelConfig) -> list[str]:
    a, problems = m.mla, []
    for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        if getattr(a, name) <= 0:
            problems.append(f"model.mla.{name} must be positive, got {getattr(a, name)}")
    for name in ("q_lora_rank", "qk_nope_head_dim"):
        if getattr(a, name) < 0:
            problems.append(f"model.mla.{name} must be >= 0, got {getattr(a, name)}")
    if a.qk_rope_head_dim > 0 and a.qk_rope_head_dim % 2:
        problems.append(
            f"model.mla.qk_rope_head_dim ({a.qk_rope_head_dim}) must be even: rotary "
            "embeddings turn pairs of dimensions"
        )
    if 0 < m.dim <= a.kv_lora_rank:
        problems.append(
            f"model.mla.kv_lora_rank ({a.kv_lora_rank}) must be below model.dim ({m.dim}): the "
            "keys and values are expanded from a latent narrower than the model"
        )
    if 0 < m.dim <= a.q_lora_rank:
        problems.append(
            f"model.mla.q_lora_rank ({a.q_lora_rank}) must be below model.dim ({m.dim}), or 0 "
            "for one full query projection"
        )
    if m.n_kv_heads != m.n_heads:
        problems.append(
            f"model.n_kv_heads ({m.n_kv_heads}) must equal model.n_heads ({m.n_heads}): "
            "multi-head latent attention expands keys and values for every head"
        )
    if m.tie_embeddings or m.qk_norm:
        problems.append(
            "model.tie_embeddings and model.qk_norm are not part of DeepSeek-V3: set both to false"
        )
    return problems


def _mtp_problems(m: ModelConfig) -> list[str]:
    mtp, problems = m.mtp, []
    if mtp.depth < 0 or mtp.loss_weight < 0:
        problems.append(
            f"model.mtp.depth ({mtp.depth}) and model.mtp.loss_weight ({mtp.loss_weight}) "
            "must be >= 0"
        )
    return problems


def _yarn_problems(m: ModelConfig) -> list[str]:
    if m.rope_scaling != "yarn":
        return []
    problems = []
    if m.rope_original_max_seq_len <= 0:
        problems.append(
            f"model.rope_original_max_seq_len must be positive (the context YaRN stretches), "
            f"got {m.rope_original_max_seq_len}"
        )
    if not 0 < m.rope_yarn_beta_slow < m.rope_yarn_beta_fast:
        problems.append(
            f"model.rope_yarn_beta_slow ({m.rope_yarn_beta_slow}) and rope_yarn_beta_fast "
            f"({m.rope_yarn_beta_fast}) must satisfy 0 < beta_slow < beta_fast"
        )
    return problems
