"""Validation of the attention options any family may use: the sliding window (per layer) and
the attention sinks."""

from __future__ import annotations

from kiln.config.sections import JobConfig


def attention_problems(cfg: JobConfig) -> list[str]:
    """Every problem of model.sliding_window, model.layer_types and model.attention_sinks."""
    m, p = cfg.model, []
    if m.family != "llama" and (m.sliding_window or m.layer_types or m.attention_sinks):
        return [
            f"model.sliding_window, model.layer_types and model.attention_sinks are options of "
            f"the llama family's attention; family {m.family!r} computes its own (multi-head "
            f"latent attention has no window or sinks): remove them"
        ]
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
