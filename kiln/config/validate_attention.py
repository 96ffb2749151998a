"""Validation of the options gpt-oss brought: the sliding window (per layer), the attention
sinks and biases, and the experts' clamped SwiGLU."""

from __future__ import annotations

from kiln.config.sections import JobConfig, ModelConfig


def attention_problems(cfg: JobConfig) -> list[str]:
    """Every problem of model.sliding_window, layer_types, attention_sinks, attention_bias and
    the clamped SwiGLU's model.moe.swiglu_alpha and swiglu_limit."""
    m, p = cfg.model, []
    if m.family == "qwen3_next":
        # Its layer_types (linear and full attention) are checked with the family's keys,
        # kiln/config/validate_linear_attention.py.
        return _qwen3_next_problems(m)
    options = (m.sliding_window, m.layer_types, m.attention_sinks, m.attention_bias)
    if m.family != "llama" and any(options):
        return [
            f"model.sliding_window, model.layer_types, model.attention_sinks and "
            f"model.attention_bias are options of the llama family's attention; family "
            f"{m.family!r} computes its own (multi-head latent attention has no window, sinks "
            f"or biases): remove them"
        ]
    if m.moe.swiglu_alpha <= 0 or m.moe.swiglu_limit <= 0:
        p.append(
            f"model.moe.swiglu_alpha ({m.moe.swiglu_alpha}) and model.moe.swiglu_limit "
            f"({m.moe.swiglu_limit}) must be positive (gpt-oss: 1.702 and 7.0)"
        )
    if m.sliding_window < 0:
        p.append(f"model.sliding_window must be >= 0 (0: no window), got {m.sliding_window}")
    if m.layer_types and len(m.layer_types) != m.n_layers:
        p.append(
            f"model.layer_types lists {len(m.layer_types)} layers, model.n_layers is "
            f"{m.n_layers}: list one type per layer, or none for a window on every layer"
        )
    if m.layer_types and "sliding_attention" in m.layer_types and m.sliding_window == 0:
        p.append(
            "model.layer_types has sliding_attention layers but model.sliding_window is 0: set "
            "the window's length in tokens"
        )
    if 0 < m.max_seq_len < m.sliding_window:
        p.append(
            f"model.sliding_window ({m.sliding_window}) is longer than the model's context, "
            f"model.max_seq_len ({m.max_seq_len}): no sequence reaches past the window, so it is "
            f"full attention; set model.sliding_window = 0, or a window within the context"
        )
    return p


def _qwen3_next_problems(m: ModelConfig) -> list[str]:
    options = {
        "model.sliding_window": m.sliding_window,
        "model.attention_sinks": m.attention_sinks,
        "model.attention_bias": m.attention_bias,
    }
    named = [key for key, value in options.items() if value]
    if not named:
        return []
    return [
        f"{', '.join(named)}: options of the llama family's attention; family 'qwen3_next' "
        "computes its own (gated full attention without a window, sinks or biases): remove them"
    ]
