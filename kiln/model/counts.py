"""Counts every family shares: the Mixture-of-Experts feed-forward's parameters and causal
attention's FLOPs. No torch here (kiln plan and kiln check count without it)."""

from __future__ import annotations

from kiln.config.sections import ModelConfig


def moe_params(cfg: ModelConfig) -> tuple[int, int]:
    """Parameters of one MoE feed-forward (kiln/model/moe): all of them, and those one token
    uses. Every one of them is a matmul weight (router, experts, shared experts and their
    gate); the router's expert biases are buffers, not parameters."""
    if cfg.moe.num_experts <= 0:
        return 0, 0
    d, expert = cfg.dim, 3 * cfg.dim * cfg.expert_hidden_dim
    always = d * cfg.moe.num_experts + cfg.moe.shared_experts * expert
    if cfg.moe.shared_experts and cfg.moe.shared_expert_gate:
        always += d
    return always + cfg.moe.num_experts * expert, always + cfg.moe.top_k * expert


def moe_bias_params(cfg: ModelConfig) -> tuple[int, int]:
    """The biases of one MoE feed-forward with model.moe.bias (gpt-oss: the router's and each
    expert's gate, up and down projections'): all of them, and those one token uses."""
    if cfg.moe.num_experts <= 0 or not cfg.moe.bias:
        return 0, 0
    per_expert = 2 * cfg.expert_hidden_dim + cfg.dim
    experts = cfg.moe.num_experts
    return experts + experts * per_expert, experts + cfg.moe.top_k * per_expert


def causal_attention_flops(
    seq_len: int, heads: int, key_width: int, value_width: int, *, window: int = 0
) -> int:
    """Forward + backward FLOPs per token of one layer's causal attention: scores (q·k over
    `key_width` per head) and the weighted values (`value_width` per head), 2 FLOPs per
    multiply-add each, times 3 for the backward, over the keys a query sees on average: half
    the sequence under the causal mask; under a sliding `window` W < S, W − W²/2S (the first W
    queries see fewer)."""
    if not window or window >= seq_len:
        return 3 * seq_len * heads * (key_width + value_width)
    keys_times_2s = 2 * window * seq_len - window * window  # 2S × the mean keys per query
    return 3 * keys_times_2s * heads * (key_width + value_width) // seq_len
