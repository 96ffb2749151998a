"""Hugging Face Qwen3 (dense) <-> kiln: a Llama block with per-head RMSNorms on the queries and
keys (kiln's qk_norm), a head width of its own (head_dim: 128 on every released size), and tied
embeddings on the small sizes. Sliding-window attention exists in its config but is off in every
release; a config that turns it on maps onto kiln's sliding_window and layer_types."""

from __future__ import annotations

from typing import Any

from kiln.config import ModelConfig
from kiln.model.llama.hf_llama import (
    REQUIRED_KEYS,
    attention_export_problems,
    base_fields,
    base_hf_config,
    base_problems,
    check_required,
    raise_problems,
    window_fields,
    window_hf_config,
)

# Qwen3Config's defaults for keys a config.json may leave out.
_ROPE_THETA = 10000.0
_NORM_EPS = 1e-6
_LAYER_TYPES = ("full_attention", "sliding_attention")


def qwen3_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """kiln's ModelConfig for a Qwen3ForCausalLM config.json, refusing what kiln would compute
    differently."""
    check_required(hf, REQUIRED_KEYS, "Qwen3")
    problems = base_problems(hf)
    unknown = sorted({kind for kind in hf.get("layer_types") or () if kind not in _LAYER_TYPES})
    if unknown:
        problems.append(f"layer_types {unknown} (kiln knows {', '.join(_LAYER_TYPES)})")
    raise_problems("Qwen3", problems)
    fields = base_fields(hf, rope_theta=_ROPE_THETA, norm_eps=_NORM_EPS)
    fields |= window_fields(hf, sliding_flag=True, per_layer=True)
    return ModelConfig(ffn_hidden_dim=hf["intermediate_size"], qk_norm=True, **fields)


def qwen3_hf_config(
    cfg: ModelConfig, dtype: str, special: dict[str, tuple[str, int]]
) -> dict[str, Any]:
    """A complete Qwen3ForCausalLM config.json for a dense kiln model with qk_norm."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "intermediate_size": cfg.ffn_hidden_dim,
        **base_hf_config(cfg, dtype, special),
        **window_hf_config(cfg),
        "max_window_layers": cfg.n_layers,
        "layer_types": [
            "sliding_attention" if cfg.attention_window(i) else "full_attention"
            for i in range(cfg.n_layers)
        ],
    }


def qwen3_export_problems(cfg: ModelConfig) -> list[str]:
    """Why a kiln model cannot be exported as Qwen3 (empty: it can)."""
    problems = []
    if cfg.moe.num_experts > 0:
        problems.append(
            f"model.moe.num_experts = {cfg.moe.num_experts} (Qwen3 is dense: Qwen3-MoE)"
        )
    if not cfg.qk_norm:
        problems.append("model.qk_norm = false (every Qwen3 attention normalizes q and k)")
    return problems + attention_export_problems(cfg, "Qwen3", window="per_layer")
