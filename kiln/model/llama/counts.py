"""The Llama family's parameter counts, honest training FLOPs per token and attention terms."""

from __future__ import annotations

from kiln.config.sections import ModelConfig
from kiln.model.counts import causal_attention_flops, moe_bias_params, moe_params
from kiln.model.family import AttentionTerms, ParamCount


def attention_terms(cfg: ModelConfig) -> AttentionTerms:
    """Grouped-query attention: n_heads query heads and n_kv_heads key/value heads of head_dim."""
    d, hd = cfg.dim, cfg.resolved_head_dim
    query, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    return AttentionTerms(
        kind="gqa",
        heads=cfg.n_heads,
        query_width=query,
        key_width=kv,
        value_width=kv,
        output_width=query,
        params=2 * d * query + 2 * d * kv,
        cached_width=2 * kv,
        gathered_width=2 * kv,
    )


def count_params(cfg: ModelConfig) -> ParamCount:
    d, hd = cfg.dim, cfg.resolved_head_dim
    terms = attention_terms(cfg)
    attention = terms.params
    dense_mlp = 3 * d * cfg.ffn_hidden_dim
    # Besides the matmul weights, per layer: norm gains, attention biases and sinks (gpt-oss).
    vectors = 2 * d + (2 * hd if cfg.qk_norm else 0) + (cfg.n_heads if cfg.attention_sinks else 0)
    if cfg.attention_bias:
        vectors += terms.query_width + terms.key_width + terms.value_width + d
    embedding = cfg.vocab_size * d
    head = cfg.vocab_size * d
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    dense_layers = cfg.n_layers - moe_layers
    moe_total, moe_active = moe_params(cfg)
    bias_total, bias_active = moe_bias_params(cfg)
    layers_total = cfg.n_layers * (attention + vectors) + dense_layers * dense_mlp
    total = (
        embedding
        + layers_total
        + moe_layers * (moe_total + bias_total)
        + d
        + (0 if cfg.tie_embeddings else head)
    )
    idle_experts = moe_layers * (moe_total - moe_active + bias_total - bias_active)
    matmul = cfg.n_layers * attention + dense_layers * dense_mlp + moe_layers * moe_active + head
    return ParamCount(total=total, embedding=embedding, matmul=matmul, active=total - idle_experts)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward FLOPs per trained token: 6 per matmul weight a token goes through
    (with MoE: its top-k experts, not all of them) plus causal attention.

    Attention scores and values cost 12·L·S·D per token without a mask; causal halves that, and
    a layer's sliding window counts the keys it sees. The embedding lookup is a gather, not a
    matmul, and is not counted.
    """
    hd = cfg.resolved_head_dim
    attention = sum(
        causal_attention_flops(seq_len, cfg.n_heads, hd, hd, window=cfg.attention_window(i))
        for i in range(cfg.n_layers)
    )
    return 6 * count_params(cfg).matmul + attention
