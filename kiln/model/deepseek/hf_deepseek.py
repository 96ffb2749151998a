"""Hugging Face DeepSeek-V3 configs (`DeepseekV3ForCausalLM`, model_type "deepseek_v3", or
"kimi_k2" for Moonshot's Kimi K2, whose remote code is DeepSeek-V3's modeling and whose keys mean
the same) <-> kiln's ModelConfig of the deepseek_v3 family.

A config.json is read in the spelling of transformers 5 (`rope_parameters`, which holds
rope_theta) or of the released checkpoints and transformers 4 (`rope_scaling` with `type`, and
rope_theta at the top level). Every key whose value would make transformers' model (or DeepSeek's
own inference code, for keys transformers ignores) compute something kiln's does not is refused,
all problems in one ConfigError naming the keys. Keys that only steer training or serving
(aux_loss_alpha, seq_aux, ep_size, use_cache, output_router_logits, pretraining_tp,
attention_dropout) are ignored: kiln's own training keys ([model.moe] seq_aux_loss_weight,
bias_update_rate) are set by the recipe.
"""

from __future__ import annotations

import math
from typing import Any

from kiln.config import ModelConfig
from kiln.config.sections import MLAConfig, MoEConfig, MTPConfig
from kiln.errors import ConfigError

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"
KIMI_K2_MODEL_TYPE = "kimi_k2"

REQUIRED_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
# DeepseekV3Config's defaults (transformers 5.24) for the keys a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": 1536,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
}
_ROPE_THETA = 10000.0
# Keys of DeepSeek's own config (read by its inference code, ignored by transformers) and the
# one value kiln, like transformers, computes.
_FIXED = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}
# YaRN's rope_parameters keys <-> kiln's ModelConfig fields.
_YARN_KEYS = {
    "factor": "rope_scaling_factor",
    "original_max_position_embeddings": "rope_original_max_seq_len",
    "beta_fast": "rope_yarn_beta_fast",
    "beta_slow": "rope_yarn_beta_slow",
    "mscale": "rope_yarn_mscale",
    "mscale_all_dim": "rope_yarn_mscale_all_dim",
}


def deepseek_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """kiln's ModelConfig for a DeepseekV3ForCausalLM config.json, refusing what kiln's model
    would compute differently (ConfigError naming every such key)."""
    missing = [key for key in REQUIRED_KEYS if hf.get(key) is None]
    if missing:
        raise ConfigError(
            f"config.json lacks {', '.join(missing)}; is it a complete DeepSeek-V3 config?"
        )
    get = {**_DEFAULTS, **{key: value for key, value in hf.items() if value is not None}}.get
    problems = _model_problems(hf, get) + _moe_problems(get) + _rope_problems(hf)
    if problems:
        raise ConfigError(
            "cannot convert this DeepSeek-V3 variant: "
            + "; ".join(problems)
            + ". kiln would load it but compute different outputs"
        )
    heads = hf["num_attention_heads"]
    return ModelConfig(
        family="deepseek_v3",
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=heads,
        vocab_size=hf["vocab_size"],
        ffn_hidden_dim=hf["intermediate_size"],
        norm_eps=float(get("rms_norm_eps")),
        max_seq_len=int(get("max_position_embeddings")),
        tie_embeddings=False,
        init_std=float(get("initializer_range")),
        **_rope_fields(hf),
        moe=MoEConfig(
            num_experts=hf["n_routed_experts"],
            top_k=hf["num_experts_per_tok"],
            first_dense_layers=int(get("first_k_dense_replace")),
            ffn_hidden_dim=hf["moe_intermediate_size"],
            shared_experts=int(get("n_shared_experts")),
            router="sigmoid",
            route_norm=bool(get("norm_topk_prob")),
            route_scale=float(get("routed_scaling_factor")),
            n_groups=int(get("n_group")),
            topk_groups=int(get("topk_group")),
        ),
        mla=MLAConfig(
            q_lora_rank=int(hf.get("q_lora_rank", _DEFAULTS["q_lora_rank"]) or 0),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
        ),
        mtp=MTPConfig(depth=mtp_depth(hf)),
    )


def mtp_depth(hf: dict[str, Any]) -> int:
    """How many multi-token prediction modules the checkpoint declares (0 when it says none)."""
    return int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0)


def _model_problems(hf: dict[str, Any], get) -> list[str]:
    problems = []
    if hf.get("attention_bias"):
        problems.append("attention_bias = true (kiln's attention has no biases)")
    if get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} (kiln uses silu)")
    kv_heads = hf.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != hf["num_attention_heads"]:
        problems.append(
            f"num_key_value_heads = {kv_heads} != num_attention_heads = "
            f"{hf['num_attention_heads']} (multi-head latent attention expands keys and values "
            "for every head)"
        )
    if hf.get("tie_word_embeddings"):
        problems.append("tie_word_embeddings = true (DeepSeek-V3's output head is its own)")
    if hf.get("rope_interleave", True) is not True:
        problems.append(
            f"rope_interleave = {hf.get('rope_interleave')!r} (kiln reads the rotary rows in the "
            "interleaved layout of the released checkpoints, transformers' default)"
        )
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        problems.append(
            f"quantization_config ({method!r}: quantized weights with their scales, as DeepSeek "
            "and Kimi K2 release fp8 and Kimi K2 Thinking int4; dequantize to bf16 first)"
        )
    problems += [
        f"{key} = {hf[key]!r} (kiln computes {key} = {value!r})"
        for key, value in _FIXED.items()
        if hf.get(key) is not None and hf[key] != value
    ]
    return problems


def _moe_problems(get) -> list[str]:
    problems = []
    for key in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group"):
        if int(get(key)) < 1:
            problems.append(f"{key} = {get(key)} (DeepSeek-V3's blocks need at least one)")
    if int(get("topk_group")) < 1 or int(get("topk_group")) > int(get("n_group")):
        problems.append(f"topk_group = {get('topk_group')} (must be in 1..n_group)")
    return problems


def rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings: transformers 5 keeps rope_theta inside `rope_parameters`; the released
    configs and transformers 4 keep it at the top level beside an optional `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "rope_theta" in hf:
        params = {"rope_theta": hf["rope_theta"], **params}
    return params


def _rope_kind(rope: dict[str, Any]) -> str:
    # The released configs spell it `type`.
    return rope.get("rope_type", rope.get("type", "default"))


def _rope_problems(hf: dict[str, Any]) -> list[str]:
    rope = rope_params(hf)
    kind = _rope_kind(rope)
    if kind not in ("default", "yarn"):
        return [f"RoPE scaling {kind!r} (kiln implements plain RoPE and YaRN)"]
    problems = []
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append("partial_rotary_factor != 1 (the whole qk_rope_head_dim rotates)")
    if kind != "yarn":
        return problems
    if rope.get("truncate", True) is not True:
        problems.append("YaRN truncate = false (kiln rounds the ramp's ends, as DeepSeek-V3)")
    if rope.get("original_max_position_embeddings") is None:
        problems.append("YaRN without original_max_position_embeddings")
        return problems
    given = rope.get("attention_factor")
    if given is not None:
        fields = _rope_fields(hf)
        derived = yarn_attention_factor(
            fields["rope_scaling_factor"],
            fields["rope_yarn_mscale"],
            fields["rope_yarn_mscale_all_dim"],
        )
        if not math.isclose(float(given), derived, rel_tol=1e-9):
            problems.append(
                f"YaRN attention_factor = {given} (kiln derives {derived} from factor, mscale "
                "and mscale_all_dim)"
            )
    return problems


def yarn_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The factor on cos and sin transformers derives (kiln/model/rope.py computes the same)."""

    def magnitude(scale: float) -> float:
        return 0.1 * scale * math.log(factor) + 1.0 if factor > 1 else 1.0

    if mscale and mscale_all_dim:
        return magnitude(mscale) / magnitude(mscale_all_dim)
    return magnitude(1.0)


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """kiln's rope_* fields. transformers reads a missing or zero mscale as "none" and falls
    back to mscale 1 for the tables; kiln does the same with rope_yarn_mscale = 0."""
    rope = rope_params(hf)
    fields: dict[str, Any] = {"rope_theta": float(rope.get("rope_theta", _ROPE_THETA))}
    if _rope_kind(rope) != "yarn":
        return fields
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor")
    if factor is None:  # transformers: the stretch from the original context to the new one
        factor = hf.get("max_position_embeddings", _DEFAULTS["max_position_embeddings"]) / original
    return {
        **fields,
        "rope_scaling": "yarn",
        "rope_scaling_factor": float(factor),
        "rope_original_max_seq_len": original,
        "rope_yarn_beta_fast": float(rope.get("beta_fast") or 32.0),
        "rope_yarn_beta_slow": float(rope.get("beta_slow") or 1.0),
        "rope_yarn_mscale": float(rope.get("mscale") or 0.0),
        "rope_yarn_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
    }


def deepseek_hf_config(
    cfg: ModelConfig, dtype: str, special: dict[str, tuple[str, int]]
) -> dict[str, Any]:
    """A complete DeepseekV3ForCausalLM config.json, in the layout of the released checkpoints:
    interleaved rotary rows, the multi-token prediction modules as layers num_hidden_layers..."""
    scaling = None
    if cfg.rope_scaling == "yarn":
        scaling = {key: getattr(cfg, field) for key, field in _YARN_KEYS.items()}
        scaling["rope_type"] = "yarn"
    moe = cfg.moe
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_dim,
        "moe_intermediate_size": cfg.expert_hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "n_shared_experts": moe.shared_experts,
        "n_routed_experts": moe.num_experts,
        "routed_scaling_factor": moe.route_scale,
        "kv_lora_rank": cfg.mla.kv_lora_rank,
        "q_lora_rank": cfg.mla.q_lora_rank or None,
        "qk_rope_head_dim": cfg.mla.qk_rope_head_dim,
        "v_head_dim": cfg.mla.v_head_dim,
        "qk_nope_head_dim": cfg.mla.qk_nope_head_dim,
        "n_group": moe.n_groups,
        "topk_group": moe.topk_groups,
        "num_experts_per_tok": moe.top_k,
        "first_k_dense_replace": moe.first_dense_layers,
        "norm_topk_prob": moe.route_norm,
        **_FIXED,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        # Both spellings: transformers 4 and DeepSeek's code read rope_theta/rope_scaling,
        # transformers 5 rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if scaling is None else {**scaling, "type": "yarn"},
        "rope_parameters": {
            "rope_type": "default",
            **(scaling or {}),
            "rope_theta": cfg.rope_theta,
        },
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": cfg.mtp.depth,
        "use_cache": True,
        "torch_dtype": dtype,
        "bos_token_id": special["bos"][1] if "bos" in special else None,
        "eos_token_id": special["eos"][1] if "eos" in special else None,
    }


def deepseek_export_problems(cfg: ModelConfig) -> list[str]:
    """Why a kiln model cannot be exported as DeepseekV3ForCausalLM (empty: it can)."""
    moe, problems = cfg.moe, []
    if moe.num_experts <= 0:
        return [f"model.moe.num_experts = {moe.num_experts} (DeepSeek-V3 has routed experts)"]
    if moe.router != "sigmoid":
        problems.append(f"model.moe.router = {moe.router!r} (DeepSeek-V3 routes by sigmoid)")
    if moe.frequency != 1:
        problems.append(
            f"model.moe.frequency = {moe.frequency} (every DeepSeek-V3 block from "
            "first_k_dense_replace on is MoE)"
        )
    if moe.shared_experts < 1 or moe.shared_expert_gate:
        problems.append(
            f"model.moe.shared_experts = {moe.shared_experts}, shared_expert_gate = "
            f"{str(moe.shared_expert_gate).lower()} (DeepSeek-V3 has ungated shared experts)"
        )
    if moe.capacity_factor > 0:
        problems.append(f"model.moe.capacity_factor = {moe.capacity_factor} (it drops no tokens)")
    if cfg.n_kv_heads != cfg.n_heads or cfg.tie_embeddings or cfg.qk_norm:
        problems.append("n_kv_heads != n_heads, tied embeddings or qk_norm (not DeepSeek-V3's)")
    if cfg.rope_scaling not in ("none", "yarn"):
        problems.append(f"model.rope_scaling = {cfg.rope_scaling!r} (DeepSeek-V3 uses YaRN)")
    return problems
