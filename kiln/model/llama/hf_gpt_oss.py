"""Hugging Face gpt-oss (GptOssForCausalLM) <-> kiln: a Llama-family MoE block with biases on the
attention projections, attention sinks, sliding-window attention on every other layer, YaRN
rotary positions (ramp ends not rounded), a router with a bias whose top-k logits are
softmaxed (kiln's softmax_topk with route_norm: the same weights), and experts with biases and
a clamped SwiGLU. The released experts are stored in MXFP4 and dequantized on import
(kiln/checkpoint/mxfp4.py); export writes them unquantized, in the export dtype."""

from __future__ import annotations

from typing import Any

from kiln.config import ModelConfig
from kiln.config.sections import MoEConfig
from kiln.errors import KilnError
from kiln.model.family import HfPart, NameMap
from kiln.model.llama.hf_llama import (
    REQUIRED_KEYS,
    base_fields,
    base_hf_config,
    check_required,
    raise_problems,
    rope_params,
    rope_type,
)

ARCHITECTURE = "GptOssForCausalLM"
# GptOssConfig's defaults for keys a config.json may leave out.
_ROPE_THETA = 150000.0
_NORM_EPS = 1e-5
_YARN = {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
_ORIGINAL_CONTEXT = 4096
_LAYER_TYPES = ("full_attention", "sliding_attention")


def gpt_oss_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """kiln's ModelConfig for a GptOssForCausalLM config.json, refusing what kiln would compute
    differently."""
    architectures = hf.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in architectures:
        raise KilnError(
            f"unsupported model: model_type 'gpt_oss' with architectures {architectures}; only "
            f"{ARCHITECTURE} checkpoints can be converted"
        )
    check_required(hf, (*REQUIRED_KEYS, "num_local_experts", "num_experts_per_tok"), "gpt-oss")
    rope = _rope(hf)
    problems = []
    if rope_type(rope) not in ("yarn", "default"):
        problems.append(f"RoPE scaling {rope_type(rope)!r} (gpt-oss uses 'yarn')")
    if rope.get("attention_factor") is not None or rope.get("partial_rotary_factor", 1.0) != 1:
        problems.append("YaRN attention_factor or partial_rotary_factor (kiln derives the first)")
    quantized = (hf.get("quantization_config") or {}).get("quant_method")
    if quantized not in (None, "mxfp4"):
        problems.append(f"quantization_config {quantized!r} (kiln reads bf16 or MXFP4 experts)")
    types = _layer_types(hf)
    if unknown := sorted(set(types) - set(_LAYER_TYPES)):
        problems.append(f"layer_types {unknown} (kiln knows {', '.join(_LAYER_TYPES)})")
    raise_problems("gpt-oss", problems)
    fields = base_fields(
        {**hf, "rope_parameters": rope}, rope_theta=_ROPE_THETA, norm_eps=_NORM_EPS
    )
    window = hf.get("sliding_window") or 0
    if window >= fields["max_seq_len"] or "sliding_attention" not in types:
        window, types = 0, []
    return ModelConfig(
        **fields,
        **_yarn_fields(rope),
        ffn_hidden_dim=hf["intermediate_size"],
        attention_bias=bool(hf.get("attention_bias", True)),
        attention_sinks=True,
        sliding_window=window,
        layer_types=types,
        moe=MoEConfig(
            num_experts=hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            router="softmax_topk",
            route_norm=True,
            bias=True,
            activation="clamped_swiglu",
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        ),
    )


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The config's RoPE parameters; GptOssConfig's YaRN where it gives none."""
    rope = rope_params(hf)
    if rope_type(rope) == "default" and "factor" not in rope:
        rope = {**rope, "rope_type": "yarn", **_YARN}
        rope.setdefault("original_max_position_embeddings", _ORIGINAL_CONTEXT)
    return rope


def _yarn_fields(rope: dict[str, Any]) -> dict[str, Any]:
    if rope_type(rope) != "yarn":
        return {}
    return {
        "rope_scaling": "yarn",
        "rope_scaling_factor": float(rope.get("factor", _YARN["factor"])),
        "rope_original_max_seq_len": int(
            rope.get("original_max_position_embeddings", _ORIGINAL_CONTEXT)
        ),
        "rope_yarn_beta_fast": float(rope.get("beta_fast", _YARN["beta_fast"])),
        "rope_yarn_beta_slow": float(rope.get("beta_slow", _YARN["beta_slow"])),
        # transformers' YaRN without mscale keys scales cos and sin by 0.1·ln(factor) + 1:
        # kiln's table_scale with mscale_all_dim = 0.
        "rope_yarn_mscale": 1.0,
        "rope_yarn_mscale_all_dim": 0.0,
        "rope_yarn_truncate": bool(rope.get("truncate", True)),
    }


def _layer_types(hf: dict[str, Any]) -> list[str]:
    """GptOssConfig's default: sliding attention on even layers, full on odd ones."""
    n = hf["num_hidden_layers"]
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    return list(hf.get("layer_types") or default)


def gpt_oss_hf_config(
    cfg: ModelConfig, dtype: str, special: dict[str, tuple[str, int]]
) -> dict[str, Any]:
    """A complete GptOssForCausalLM config.json (unquantized experts) for kiln's model."""
    base = base_hf_config(cfg, dtype, special)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "yarn":
        rope |= {
            "rope_type": "yarn",
            "factor": cfg.rope_scaling_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len,
            "beta_fast": cfg.rope_yarn_beta_fast,
            "beta_slow": cfg.rope_yarn_beta_slow,
            "truncate": cfg.rope_yarn_truncate,
        }
    windowed = [cfg.attention_window(i) for i in range(cfg.n_layers)]
    return {
        **base,
        "architectures": [ARCHITECTURE],
        "model_type": "gpt_oss",
        "rope_scaling": None,
        "rope_parameters": rope,
        "attention_bias": cfg.attention_bias,
        "intermediate_size": cfg.expert_hidden_dim,
        "num_local_experts": cfg.moe.num_experts,
        "num_experts_per_tok": cfg.moe.top_k,
        "swiglu_alpha": cfg.moe.swiglu_alpha,
        "swiglu_limit": cfg.moe.swiglu_limit,
        "router_aux_loss_coef": cfg.moe.aux_loss_weight,
        "output_router_logits": False,
        "sliding_window": cfg.sliding_window or None,
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
    }


def gpt_oss_export_problems(cfg: ModelConfig) -> list[str]:
    """Why a kiln model cannot be exported as gpt-oss (empty: it can)."""
    moe, problems = cfg.moe, []
    wanted = {
        "model.attention_sinks": (cfg.attention_sinks, True),
        "model.qk_norm": (cfg.qk_norm, False),
        "model.moe.bias": (moe.bias, True),
        "model.moe.activation": (moe.activation, "clamped_swiglu"),
        "model.moe.router": (moe.router, "softmax_topk"),
        "model.moe.route_norm": (moe.route_norm, True),
        "model.moe.route_scale": (moe.route_scale, 1.0),
        "model.moe.shared_experts": (moe.shared_experts, 0),
        "model.moe.n_groups": (moe.n_groups, 1),
    }
    problems += [
        f"{key} = {got!r} (gpt-oss: {want!r})" for key, (got, want) in wanted.items() if got != want
    ]
    if moe.num_experts <= 0 or any(not cfg.is_moe_layer(i) for i in range(cfg.n_layers)):
        problems.append("dense blocks (every gpt-oss block is MoE)")
    if cfg.rope_scaling not in ("yarn", "none"):
        problems.append(f"model.rope_scaling = {cfg.rope_scaling!r} (gpt-oss uses yarn)")
    return problems


def gpt_oss_names(cfg: ModelConfig, hf_names: set[str] | None = None) -> NameMap:
    """kiln tensor -> the gpt-oss tensors: the experts' fused gate_up_proj alternates gate and up
    units along its last dim, and the experts' weights are stored (experts, in, out)."""
    names: NameMap = {
        "tok_embeddings.weight": [HfPart("model.embed_tokens.weight")],
        "norm.weight": [HfPart("model.norm.weight")],
    }
    if not cfg.tie_embeddings:
        names["output.weight"] = [HfPart("lm_head.weight")]
    kinds = ("weight", "bias") if cfg.attention_bias else ("weight",)
    for i in range(cfg.n_layers):
        hf, kiln = f"model.layers.{i}", f"layers.{i}"
        experts = f"{hf}.mlp.experts"
        layer = {
            "attention_norm.weight": [HfPart(f"{hf}.input_layernorm.weight")],
            "ffn_norm.weight": [HfPart(f"{hf}.post_attention_layernorm.weight")],
            "attention.sinks.weight": [HfPart(f"{hf}.self_attn.sinks")],
            "feed_forward.router.gate.weight": [HfPart(f"{hf}.mlp.router.weight")],
            "feed_forward.router.gate.bias": [HfPart(f"{hf}.mlp.router.bias")],
            "feed_forward.router.expert_bias": [],
            "feed_forward.experts.w1": [HfPart(f"{experts}.gate_up_proj", interleave=0, transposed=True)],
            "feed_forward.experts.w3": [HfPart(f"{experts}.gate_up_proj", interleave=1, transposed=True)],
            "feed_forward.experts.w2": [HfPart(f"{experts}.down_proj", transposed=True)],
            "feed_forward.experts.b1": [HfPart(f"{experts}.gate_up_proj_bias", interleave=0)],
            "feed_forward.experts.b3": [HfPart(f"{experts}.gate_up_proj_bias", interleave=1)],
            "feed_forward.experts.b2": [HfPart(f"{experts}.down_proj_bias")],
        }  # fmt: skip
        for proj, hf_proj in (
            ("wq", "q_proj"),
            ("wk", "k_proj"),
            ("wv", "v_proj"),
            ("wo", "o_proj"),
        ):
            for kind in kinds:
                layer[f"attention.{proj}.{kind}"] = [HfPart(f"{hf}.self_attn.{hf_proj}.{kind}")]
        names.update({f"{kiln}.{name}": parts for name, parts in layer.items()})
    return names
