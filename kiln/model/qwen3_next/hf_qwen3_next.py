"""Hugging Face Qwen3-Next and Qwen3.5 config.json <-> kiln's ModelConfig (family qwen3_next).

Three text architectures share the keys: Qwen3NextForCausalLM (model_type "qwen3_next": MoE on
the blocks decoder_sparse_step and mlp_only_layers choose, norm_topk_prob), Qwen3_5ForCausalLM
("qwen3_5_text": a dense SwiGLU) and Qwen3_5MoeForCausalLM ("qwen3_5_moe_text": MoE on every
block, the top-k weights always renormalized). Each has gated full attention with q/k norms,
partial rotary positions and zero-centred RMSNorms, with no key to turn them off. Qwen3.5 is
released as a vision-language model (model_type "qwen3_5" / "qwen3_5_moe", the language model's
keys in `text_config`); its multimodal RoPE sections turn a text token's positions like plain
RoPE, since text positions are the same in all three sections.
"""

from __future__ import annotations

from typing import Any

from kiln.config.sections import LinearAttentionConfig, ModelConfig, MoEConfig
from kiln.errors import KilnError

# model_type of the text architectures -> (architecture, name in messages).
TEXT_TYPES = {
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3-Next"),
    "qwen3_5_text": ("Qwen3_5ForCausalLM", "Qwen3.5"),
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", "Qwen3.5-MoE"),
}
# model_type of the vision-language releases -> (architecture, their text_config's model_type).
MULTIMODAL_TYPES = {
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "qwen3_5_text"),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text"),
}
_BASE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
)
_MOE_KEYS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
_LAYER_TYPES = ("linear_attention", "full_attention")
# The config classes' defaults (the same in all three) for keys a config.json may leave out.
_DEFAULTS = {
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "max_position_embeddings": 32768,
    "full_attention_interval": 4,
}


def text_config(hf: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The text architecture's model_type and the keys of its language model: config.json
    itself, or a vision-language release's text_config with the top level's word-embedding
    tying (what its ForConditionalGeneration model ties) and quantization."""
    kind = hf["model_type"]
    if kind not in MULTIMODAL_TYPES:
        return kind, hf
    architecture, text_kind = MULTIMODAL_TYPES[kind]
    text = hf.get("text_config")
    if not isinstance(text, dict) or text.get("model_type", text_kind) != text_kind:
        raise KilnError(
            f"config.json of model_type {kind!r} ({architecture}) lacks a text_config of "
            f"model_type {text_kind!r}; is it a complete Qwen3.5 config?"
        )
    top = {key: hf[key] for key in ("tie_word_embeddings", "quantization_config") if key in hf}
    return text_kind, {**text, "tie_word_embeddings": False, **top}


def qwen3_next_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """kiln's ModelConfig for a Qwen3-Next or Qwen3.5 config.json (text or vision-language),
    refusing, in one message naming each, what kiln's model would compute differently."""
    kind, text = text_config(hf)
    name = TEXT_TYPES[kind][1]
    moe = kind == "qwen3_5_moe_text" or (kind == "qwen3_next" and text.get("num_experts", 1) > 0)
    # Qwen3-Next's dense blocks (mlp_only_layers) are intermediate_size wide.
    dense = ("intermediate_size",) if kind != "qwen3_5_moe_text" else ()
    required = (*_BASE_KEYS, *(_MOE_KEYS if moe else ()), *dense)
    missing = [key for key in required if key not in text]
    if missing:
        raise KilnError(f"config.json lacks {', '.join(missing)}; is it a complete {name} config?")
    rope, rope_problems = _rope(text)
    types, type_problems = _layer_types(text)
    moe_fields, moe_problems = _moe_fields(text, kind) if moe else ({}, [])
    problems = _problems(text) + rope_problems + type_problems + moe_problems
    if problems:
        raise KilnError(
            f"cannot convert this {name} variant: "
            + "; ".join(problems)
            + ". kiln would load it but compute different outputs"
        )

    def value(key: str) -> Any:
        return text.get(key, _DEFAULTS[key])

    return ModelConfig(
        family="qwen3_next",
        dim=text["hidden_size"],
        n_layers=text["num_hidden_layers"],
        n_heads=text["num_attention_heads"],
        n_kv_heads=text["num_key_value_heads"],
        head_dim=int(value("head_dim")),
        vocab_size=text["vocab_size"],
        # Qwen3.5-MoE has no dense block and no intermediate_size: the experts' width stands in.
        ffn_hidden_dim=text.get("intermediate_size") or text.get("moe_intermediate_size"),
        norm_eps=float(value("rms_norm_eps")),
        rope_theta=float(rope["rope_theta"]),
        max_seq_len=int(value("max_position_embeddings")),
        tie_embeddings=bool(text.get("tie_word_embeddings", False)),
        init_std=float(text.get("initializer_range", 0.02)),
        qk_norm=True,
        attention_output_gate=True,
        partial_rotary_factor=float(rope["partial_rotary_factor"]),
        norm_zero_centered=True,
        layer_types=types,
        linear_attention=LinearAttentionConfig(
            num_key_heads=text["linear_num_key_heads"],
            num_value_heads=text["linear_num_value_heads"],
            key_head_dim=text["linear_key_head_dim"],
            value_head_dim=text["linear_value_head_dim"],
            conv_kernel=int(value("linear_conv_kernel_dim")),
        ),
        moe=MoEConfig(**moe_fields),
    )


def _problems(text: dict[str, Any]) -> list[str]:
    problems = []
    if text.get("attention_bias"):
        problems.append("attention_bias = true (kiln's attention has no biases)")
    if text.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {text['hidden_act']!r} (kiln uses silu)")
    keys, values = text["linear_num_key_heads"], text["linear_num_value_heads"]
    if keys <= 0 or values % keys:
        problems.append(
            f"linear_num_value_heads = {values} is not a multiple of linear_num_key_heads = "
            f"{keys} (each key head serves a whole group of value heads)"
        )
    if text.get("quantization_config"):
        method = text["quantization_config"].get("quant_method", "?")
        problems.append(
            f"quantization_config ({method!r}: kiln reads bf16/fp16/fp32 weights; dequantize "
            "them first, or convert the unquantized release)"
        )
    return problems


def _rope(text: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """rope_theta and partial_rotary_factor in either spelling (transformers 5's
    rope_parameters, 4.x's top-level keys beside rope_scaling), and the problem of a RoPE type
    kiln does not compute for this family."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    rope = {
        key: params.get(key, text.get(key, _DEFAULTS[key]))
        for key in ("rope_theta", "partial_rotary_factor")
    }
    if kind != "default":
        return rope, [f"RoPE scaling {kind!r} (kiln computes plain RoPE for this family)"]
    return rope, []


def _layer_types(text: dict[str, Any]) -> tuple[list[str], list[str]]:
    """layer_types, or the pattern full_attention_interval makes (every n-th layer full)."""
    n_layers = text["num_hidden_layers"]
    interval = text.get("full_attention_interval", _DEFAULTS["full_attention_interval"])
    types = list(text.get("layer_types") or ())
    if not types:
        types = [_LAYER_TYPES[(i + 1) % interval == 0] for i in range(n_layers)]
    unknown = sorted({kind for kind in types if kind not in _LAYER_TYPES})
    if unknown:
        return [], [f"layer_types {unknown} (kiln knows {', '.join(_LAYER_TYPES)})"]
    if len(types) != n_layers:
        return [], [f"layer_types lists {len(types)} layers for num_hidden_layers = {n_layers}"]
    return types, []


def _moe_fields(text: dict[str, Any], kind: str) -> tuple[dict[str, Any], list[str]]:
    """[model.moe] for the experts, the gated shared expert and the MoE blocks: Qwen3-Next's
    block i is MoE when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0,
    Qwen3.5-MoE's every block; kiln's rule is every moe.frequency-th block from
    moe.first_dense_layers on."""
    width, shared = text["moe_intermediate_size"], text["shared_expert_intermediate_size"]
    fields: dict[str, Any] = dict(
        num_experts=text["num_experts"],
        top_k=text["num_experts_per_tok"],
        ffn_hidden_dim=width,
        shared_experts=shared // width if width > 0 else 0,
        shared_expert_gate=True,
        router="softmax_topk",
        route_norm=bool(text.get("norm_topk_prob", True)) if kind == "qwen3_next" else True,
    )
    problems = []
    if width <= 0 or shared <= 0 or shared % width:
        problems.append(
            f"shared_expert_intermediate_size = {shared} is not a positive multiple of "
            f"moe_intermediate_size = {width} (kiln's shared experts are whole experts wide)"
        )
    n_layers, step = text["num_hidden_layers"], text.get("decoder_sparse_step", 1)
    dense = sorted(text.get("mlp_only_layers") or [])
    if not isinstance(step, int) or step < 1:
        return fields, [*problems, f"decoder_sparse_step = {step!r} (a positive integer)"]
    blocks = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
    if not blocks:
        how = f"decoder_sparse_step = {step}, mlp_only_layers = {dense}"
        return fields, [*problems, f"no MoE block ({how}): leave num_experts at 0 for none"]
    fields["first_dense_layers"] = blocks[0]
    fields["frequency"] = blocks[1] - blocks[0] if len(blocks) > 1 else n_layers - blocks[0]
    kiln = ModelConfig(n_layers=n_layers, moe=MoEConfig(**{**fields, "num_experts": 1}))
    if [i for i in range(n_layers) if kiln.is_moe_layer(i)] != blocks:
        problems.append(
            f"MoE blocks {blocks} (decoder_sparse_step = {step}, mlp_only_layers = {dense}): "
            "kiln makes every moe.frequency-th block MoE from moe.first_dense_layers on and "
            "cannot express this choice"
        )
    return fields, problems


def qwen3_next_hf_config(
    cfg: ModelConfig, dtype: str, special: dict[str, tuple[str, int]], *, kind: str
) -> dict[str, Any]:
    """A complete config.json of text architecture `kind` for a kiln model it can hold."""
    a = cfg.linear_attention
    rope = {
        "rope_type": "default",
        "rope_theta": cfg.rope_theta,
        "partial_rotary_factor": cfg.partial_rotary_factor,
    }
    config: dict[str, Any] = {
        "architectures": [TEXT_TYPES[kind][0]],
        "model_type": kind,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "layer_types": list(cfg.layer_types),
        "linear_num_key_heads": a.num_key_heads,
        "linear_num_value_heads": a.num_value_heads,
        "linear_key_head_dim": a.key_head_dim,
        "linear_value_head_dim": a.value_head_dim,
        "linear_conv_kernel_dim": a.conv_kernel,
        "intermediate_size": cfg.ffn_hidden_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        # Both spellings: transformers 4.x reads the top-level keys, 5.x rope_parameters.
        "rope_parameters": rope,
        "rope_theta": cfg.rope_theta,
        "partial_rotary_factor": cfg.partial_rotary_factor,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "vocab_size": cfg.vocab_size,
        "use_cache": True,
        "torch_dtype": dtype,
        "bos_token_id": special["bos"][1] if "bos" in special else None,
        "eos_token_id": special["eos"][1] if "eos" in special else None,
    }
    if cfg.moe.num_experts > 0:
        config.update(
            num_experts=cfg.moe.num_experts,
            num_experts_per_tok=cfg.moe.top_k,
            moe_intermediate_size=cfg.expert_hidden_dim,
            shared_expert_intermediate_size=cfg.moe.shared_experts * cfg.expert_hidden_dim,
            output_router_logits=False,
        )
    if kind == "qwen3_next":
        # Every block MoE but those listed: any choice of kiln's rule.
        config.update(
            norm_topk_prob=cfg.moe.route_norm,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)],
        )
    return config


def export_problems(cfg: ModelConfig, *, kind: str) -> list[str]:
    """Why a kiln model of family qwen3_next cannot be exported as text architecture `kind`
    (empty: it can)."""
    name, moe = TEXT_TYPES[kind][1], cfg.moe
    problems = [
        f"model.{key} = false (every {name} {what})"
        for key, what in (
            ("qk_norm", "attention normalizes q and k"),
            ("attention_output_gate", "full attention gates its output"),
            ("norm_zero_centered", "RMSNorm is zero-centred"),
        )
        if not getattr(cfg, key)
    ]
    if cfg.rope_scaling != "none":
        problems.append(f"model.rope_scaling = {cfg.rope_scaling!r} (the export writes plain RoPE)")
    if kind == "qwen3_5_text":
        if moe.num_experts > 0:
            problems.append(f"model.moe.num_experts = {moe.num_experts} ({name} is dense)")
        return problems
    if moe.num_experts <= 0:
        return [*problems, f"model.moe.num_experts = {moe.num_experts} ({name} has experts)"]
    if moe.router != "softmax_topk":
        problems.append(f"model.moe.router = {moe.router!r} ({name} uses softmax_topk)")
    if moe.route_scale != 1.0:
        problems.append(f"model.moe.route_scale = {moe.route_scale} ({name} has no scale)")
    if moe.topk_groups < moe.n_groups:
        problems.append(f"group-limited routing (moe.n_groups = {moe.n_groups})")
    if moe.capacity_factor > 0:
        problems.append(f"model.moe.capacity_factor = {moe.capacity_factor} ({name} drops none)")
    if moe.bias or moe.activation != "swiglu":
        problems.append(f"expert biases or moe.activation {moe.activation!r} ({name}: SwiGLU)")
    if moe.shared_experts <= 0 or not moe.shared_expert_gate:
        problems.append(
            f"model.moe.shared_experts = {moe.shared_experts}, shared_expert_gate = "
            f"{str(moe.shared_expert_gate).lower()} ({name} has one gated shared expert)"
        )
    if kind == "qwen3_5_moe_text":
        if not moe.route_norm:
            problems.append(f"model.moe.route_norm = false ({name} renormalizes the top k)")
        if not all(cfg.is_moe_layer(i) for i in range(cfg.n_layers)):
            problems.append(f"dense blocks (every {name} block is MoE)")
    return problems
