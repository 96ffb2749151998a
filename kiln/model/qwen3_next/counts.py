"""The qwen3_next family's parameter counts, honest training FLOPs per token and attention terms.
No torch here (kiln plan and kiln check count without it)."""

from __future__ import annotations

import math

from kiln.config.sections import ModelConfig
from kiln.model.counts import causal_attention_flops, moe_bias_params, moe_params
from kiln.model.family import AttentionTerms, LinearMixerTerms, ParamCount


def attention_terms(cfg: ModelConfig) -> AttentionTerms:
    """The full-attention layers' shape: grouped-query attention whose query projection also
    makes the output gate when model.attention_output_gate is set.

    The full-attention layers only: the Gated DeltaNet layers are `linear_mixer_terms`.
    """
    d, hd = cfg.dim, cfg.resolved_head_dim
    query, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    gate = query if cfg.attention_output_gate else 0
    return AttentionTerms(
        kind="gqa",
        heads=cfg.n_heads,
        query_width=query,
        key_width=kv,
        value_width=kv,
        output_width=query,
        params=d * (2 * query + gate) + 2 * d * kv,
        cached_width=2 * kv,
        gathered_width=2 * kv,
    )


def linear_attention_params(cfg: ModelConfig) -> tuple[int, int]:
    """One Gated DeltaNet layer's parameters: its projections' (matmul weights: wq, wk, wv, wz,
    wb, wa, wo) and the rest (the convolution's taps, A_log, dt_bias, the gated norm)."""
    a, d = cfg.linear_attention, cfg.dim
    keys, values = a.num_key_heads * a.key_head_dim, a.num_value_heads * a.value_head_dim
    matmul = d * (2 * keys + 2 * values + 2 * a.num_value_heads) + values * d
    other = (2 * keys + values) * a.conv_kernel + 2 * a.num_value_heads + a.value_head_dim
    return matmul, other


# fla-core's chunk length: its kernel keeps, per token and value head, one row of its chunk's
# solved triangular matrix A (bf16).
FLA_CHUNK = 64


def gated_deltanet_bytes_around_kernel(cfg: ModelConfig) -> int:
    """What a Gated DeltaNet layer (gated_deltanet.py) keeps for backward per token around its
    kernel, bf16 compute, at tp=1: the short convolution's input (2·(2·keys + values),
    short_conv.py); the L2 norms' fp32 queries and keys (4·2·keys) and rstd (4 per key head
    each); β's fp32 sigmoid, the decay's softplus input and output (4 each per value head); the
    gated norm's two bf16 inputs, the kernel's output and the gate (2·values each: the norm is
    recomputed in backward); the output projection's input (2·values). Measured with
    saved-tensor hooks (tests/unit/test_plan_memory_linear.py)."""
    a = cfg.linear_attention
    keys, values = a.num_key_heads * a.key_head_dim, a.num_value_heads * a.value_head_dim
    conv = 2 * (2 * keys + values)
    l2 = 4 * 2 * keys + 4 * 2 * a.num_key_heads
    gates = 3 * 4 * a.num_value_heads
    gated_norm = 2 * 2 * values
    return conv + l2 + gates + gated_norm + 2 * values


def fla_kernel_bytes(cfg: ModelConfig) -> int:
    """What fla-core's chunked gated delta rule keeps per token beyond the tensors the layer
    keeps anyway (its `save_for_backward`, fla/ops/gated_delta_rule/chunk.py): the queries and
    keys repeated to the value heads (bf16, key_head_dim per value head each), the values
    (bf16), the decays' chunk-local cumulative sum (fp32) and a row of A (FLA_CHUNK, bf16) per
    value head; β is the layer's own sigmoid output."""
    a = cfg.linear_attention
    per_value_head = 2 * 2 * a.key_head_dim + 2 * a.value_head_dim + 4 + 2 * FLA_CHUNK
    return a.num_value_heads * per_value_head


def linear_mixer_terms(cfg: ModelConfig) -> LinearMixerTerms | None:
    """The Gated DeltaNet layers for the planner: their count, weights and kept activations
    (around the kernel and fla-core's, the kernel kiln runs on CUDA)."""
    layers = linear_layers(cfg)
    if layers == 0:
        return None
    matmul, other = linear_attention_params(cfg)
    kept = gated_deltanet_bytes_around_kernel(cfg) + fla_kernel_bytes(cfg)
    return LinearMixerTerms(layers=layers, params=matmul + other, kept_bytes_per_token=kept)


def linear_layers(cfg: ModelConfig) -> int:
    """How many blocks are Gated DeltaNet layers."""
    return sum(cfg.is_linear_attention_layer(i) for i in range(cfg.n_layers))


def count_params(cfg: ModelConfig) -> ParamCount:
    """Total, embedding, matmul and active parameters of the model the family builds."""
    d, hd = cfg.dim, cfg.resolved_head_dim
    linear = linear_layers(cfg)
    full = cfg.n_layers - linear
    full_attention = attention_terms(cfg).params
    linear_matmul, linear_other = linear_attention_params(cfg)
    dense_mlp = 3 * d * cfg.ffn_hidden_dim
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    dense_layers = cfg.n_layers - moe_layers
    moe_total, moe_active = moe_params(cfg)
    bias_total, bias_active = moe_bias_params(cfg)
    # Per block: its two norms; per full-attention layer its q/k norms.
    norms = cfg.n_layers * 2 * d + (full * 2 * hd if cfg.qk_norm else 0)
    embedding = head = cfg.vocab_size * d
    mixing = full * full_attention + linear * (linear_matmul + linear_other)
    total = (
        embedding
        + mixing
        + norms
        + dense_layers * dense_mlp
        + moe_layers * (moe_total + bias_total)
        + d
        + (0 if cfg.tie_embeddings else head)
    )
    matmul = (
        full * full_attention
        + linear * linear_matmul
        + dense_layers * dense_mlp
        + moe_layers * moe_active
        + head
    )
    idle_experts = moe_layers * (moe_total - moe_active + bias_total - bias_active)
    return ParamCount(total=total, embedding=embedding, matmul=matmul, active=total - idle_experts)


def delta_rule_flops(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward FLOPs per token of one Gated DeltaNet layer beyond its projections:
    the causal convolution and the gated delta rule, linear in the sequence.

    Counted from the matrix products of the plain-torch chunked kernel
    (delta_rule.chunk_gated_delta_rule), per value head and chunk of C tokens with key width
    dk and value width dv: within the chunk K_β·Kᵀ and Q·Kᵀ (2·C²·dk each, the whole C × C
    products though only their lower triangles are used), the triangular solve for both
    right-hand sides (C²·(dv + dk)) and the scores times the new values (2·C²·dv); across
    chunks the reads and the write of the state (three C × dk × dv products, 6·C·dk·dv). Per
    token that is C·(5·dk + 3·dv) + 6·dk·dv, times the padding a sequence not a multiple of C
    gets, times 3 for the backward. fla-core's kernel orders the work differently at a
    similar count. The convolution is 2·K multiply-adds per channel and token, × 3.
    Elementwise work (decays, masks, the L2 norms, the gated norm) is not counted, as for the
    other families.
    """
    a = cfg.linear_attention
    c, dk, dv = a.chunk_size, a.key_head_dim, a.value_head_dim
    padded = math.ceil(seq_len / c) * c
    per_chunk = c * c * (5 * dk + 3 * dv) + 6 * c * dk * dv
    delta = 3 * a.num_value_heads * per_chunk * (padded // c) // seq_len
    channels = 2 * a.num_key_heads * dk + a.num_value_heads * dv
    return delta + 6 * a.conv_kernel * channels


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward FLOPs per trained token: 6 per matmul weight a token goes through
    (its top-k experts, not all), causal attention in the full-attention layers (kiln's count,
    kiln/model/counts.py) and the convolution and delta rule in the Gated DeltaNet layers
    (`delta_rule_flops`, linear in seq_len). The embedding lookup is not counted."""
    hd = cfg.resolved_head_dim
    linear = linear_layers(cfg)
    attention = (cfg.n_layers - linear) * causal_attention_flops(seq_len, cfg.n_heads, hd, hd)
    return 6 * count_params(cfg).matmul + attention + linear * delta_rule_flops(cfg, seq_len)
