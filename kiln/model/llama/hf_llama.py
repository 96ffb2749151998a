"""Hugging Face Llama configs <-> kiln's ModelConfig, and the Llama parts other families share.

Mixtral and Qwen3-MoE are Llama blocks with another feed-forward: the attention, norm, RoPE and
embedding keys of their config.json mean the same, so `base_fields`, `base_problems` and
`base_hf_config` serve them too (see hf_moe.py).
"""

from __future__ import annotations

from typing import Any

from kiln.config import ModelConfig
from kiln.errors import KilnError

REQUIRED_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
)

# HF Llama's defaults when a config leaves these out.
_LLAMA_ROPE_THETA = 10000.0
_LLAMA_NORM_EPS = 1e-6

# Llama 3.1's RoPE scaling (rope_type "llama3"): kiln ModelConfig field -> Hugging Face key.
LLAMA3_ROPE_KEYS = {
    "rope_scaling_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_seq_len": "original_max_position_embeddings",
}


def llama_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Map a Hugging Face Llama config.json onto kiln's ModelConfig, refusing anything kiln's
    model would compute differently."""
    architectures = hf.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in architectures:
        raise KilnError(
            f"unsupported model: model_type 'llama' with architectures {architectures}; "
            "only LlamaForCausalLM checkpoints of model_type 'llama' can be converted"
        )
    check_required(hf, REQUIRED_KEYS, "Llama")
    problems = base_problems(hf)
    if hf.get("mlp_bias"):
        problems.append("mlp_bias = true (kiln's feed-forward has no biases)")
    raise_problems("Llama", problems)
    fields = base_fields(hf, rope_theta=_LLAMA_ROPE_THETA, norm_eps=_LLAMA_NORM_EPS)
    return ModelConfig(ffn_hidden_dim=hf["intermediate_size"], **fields)


def llama_hf_config(
    cfg: ModelConfig, dtype: str, special: dict[str, tuple[str, int]]
) -> dict[str, Any]:
    """A complete LlamaForCausalLM config.json for kiln's ModelConfig."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "intermediate_size": cfg.ffn_hidden_dim,
        **base_hf_config(cfg, dtype, special),
        "mlp_bias": False,
        "pretraining_tp": 1,
    }


def check_required(hf: dict[str, Any], keys: tuple[str, ...], family: str) -> None:
    missing = [key for key in keys if key not in hf]
    if missing:
        raise KilnError(
            f"config.json lacks {', '.join(missing)}; is it a complete {family} config?"
        )


def raise_problems(family: str, problems: list[str]) -> None:
    """Converting a variant kiln does not implement would give a model that loads but computes
    something else, so every such variant is refused, with all its problems in one message."""
    if problems:
        raise KilnError(
            f"cannot convert this {family} variant: "
            + "; ".join(problems)
            + ". kiln would load it but compute different outputs"
        )


def base_problems(hf: dict[str, Any]) -> list[str]:
    """What kiln's attention, RoPE and activation cannot reproduce."""
    problems = []
    rope = rope_params(hf)
    kind = rope_type(rope)
    if kind not in ("default", "llama3"):
        problems.append(
            f"RoPE scaling {kind!r} (kiln implements plain RoPE and Llama 3.1's 'llama3')"
        )
    absent = [key for key in LLAMA3_ROPE_KEYS.values() if rope.get(key) is None]
    if kind == "llama3" and absent:
        problems.append(f"'llama3' RoPE scaling without {', '.join(absent)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append("partial rotary embeddings (partial_rotary_factor != 1)")
    if hf.get("attention_bias"):
        problems.append("attention_bias = true (kiln's attention has no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} (kiln uses silu)")
    return problems


def window_fields(hf: dict[str, Any], *, sliding_flag: bool, per_layer: bool) -> dict[str, Any]:
    """kiln's sliding_window and layer_types for a config's sliding-window attention, as
    transformers applies it: Qwen3 and Qwen3-MoE (`sliding_flag`) only with use_sliding_window;
    Qwen3 (`per_layer`) on the layers from max_window_layers on, or as its layer_types say;
    Mixtral and Qwen3-MoE on every layer. A window the context never exceeds is full
    attention: none."""
    window = hf.get("sliding_window")
    if sliding_flag and not hf.get("use_sliding_window", False):
        window = None
    context = hf.get("max_position_embeddings", 2048)
    if window is None or window >= context:
        return {}
    if not per_layer:
        return {"sliding_window": int(window)}
    n_layers, first = hf["num_hidden_layers"], hf.get("max_window_layers", hf["num_hidden_layers"])
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(n_layers)
    ]
    if "sliding_attention" not in types:
        return {}
    return {"sliding_window": int(window), "layer_types": list(types)}


def attention_export_problems(cfg: ModelConfig, family: str, *, window: str) -> list[str]:
    """What of kiln's attention options `family` cannot express: sinks never; a sliding window
    on `window` = "none", "every_layer" or "per_layer" of its layers."""
    problems = []
    if cfg.attention_sinks:
        problems.append(f"model.attention_sinks = true ({family}'s attention has no sinks)")
    windows = {cfg.attention_window(i) for i in range(cfg.n_layers)}
    if windows != {0} and window == "none":
        problems.append(f"model.sliding_window = {cfg.sliding_window} ({family} has no window)")
    elif len(windows) > 1 and window == "every_layer":
        problems.append(f"model.layer_types with full layers ({family} windows every layer)")
    return problems


def window_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The sliding-window keys of a Qwen3/Qwen3-MoE/Mixtral config.json for kiln's model."""
    if not cfg.sliding_window:
        return {"use_sliding_window": False, "sliding_window": None}
    return {"use_sliding_window": True, "sliding_window": cfg.sliding_window}


def base_fields(hf: dict[str, Any], *, rope_theta: float, norm_eps: float) -> dict[str, Any]:
    """The ModelConfig fields of the attention, norms, RoPE and embeddings. `rope_theta` and
    `norm_eps` are the family's defaults for a config that leaves them out."""
    rope = rope_params(hf)
    scaling = {}
    if rope_type(rope) == "llama3":
        scaling = {field: float(rope[key]) for field, key in LLAMA3_ROPE_KEYS.items()}
        scaling["rope_original_max_seq_len"] = int(rope["original_max_position_embeddings"])
        scaling["rope_scaling"] = "llama3"
    return dict(
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=_explicit_head_dim(hf),
        vocab_size=hf["vocab_size"],
        norm_eps=float(hf.get("rms_norm_eps", norm_eps)),
        rope_theta=float(rope.get("rope_theta", rope_theta)),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        **scaling,
    )


def _explicit_head_dim(hf: dict[str, Any]) -> int:
    """kiln's head_dim key: 0 where config.json's head_dim is hidden_size / num_attention_heads
    (or absent), so that the converted config reads like a hand-written one."""
    derived = hf["hidden_size"] // hf["num_attention_heads"]
    return 0 if hf.get("head_dim") in (None, derived) else int(hf["head_dim"])


def base_hf_config(
    cfg: ModelConfig, dtype: str, special: dict[str, tuple[str, int]]
) -> dict[str, Any]:
    """The config.json keys of the attention, norms, RoPE, embeddings and special tokens."""
    scaling = None
    if cfg.rope_scaling == "llama3":
        scaling = {key: getattr(cfg, field) for field, key in LLAMA3_ROPE_KEYS.items()}
        scaling["rope_type"] = "llama3"
    return {
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        # Both spellings: transformers 4.x reads rope_theta/rope_scaling, 5.x rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {
            "rope_type": "default",
            **(scaling or {}),
            "rope_theta": cfg.rope_theta,
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "vocab_size": cfg.vocab_size,
        "use_cache": True,
        "torch_dtype": dtype,
        "bos_token_id": special["bos"][1] if "bos" in special else None,
        "eos_token_id": special["eos"][1] if "eos" in special else None,
    }


def rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers 5.x keeps rope_theta inside `rope_parameters`; 4.x keeps it at the top level
    next to an optional `rope_scaling`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if "rope_theta" in hf:
        params = {"rope_theta": hf["rope_theta"], **params}
    return params


def rope_type(rope: dict[str, Any]) -> str:
    # transformers 4.x configs of some Llama releases spell it `type`.
    return rope.get("rope_type", rope.get("type", "default"))
