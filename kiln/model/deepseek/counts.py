"""The DeepSeek-V3 family's parameter counts, honest training FLOPs per token and attention terms:
multi-head latent attention (MLA), the dense or MoE feed-forward of each block, and the
multi-token prediction (MTP) modules, which training runs and these counts include.

Per block: attention_norm and ffn_norm (dim each); MLA (`attention_terms`); the dense SwiGLU
(w1, w2, w3 of ffn_hidden_dim) where `cfg.is_moe_layer(i)` is false, else the MoE feed-forward
(kiln/model/counts.py). MTP module k (of `cfg.mtp.depth`) holds hidden_norm, embed_norm and norm
(dim each), proj (dim × 2·dim) and one block numbered n_layers + k; it shares the main model's
embedding and output head, so adds no parameters for them but one more pass through the head.
"""

from __future__ import annotations

from kiln.config.sections import ModelConfig
from kiln.model.counts import causal_attention_flops, moe_params
from kiln.model.family import AttentionTerms, ParamCount


def attention_terms(cfg: ModelConfig) -> AttentionTerms:
    """Multi-head latent attention: queries through a q_lora_rank latent (or one projection),
    keys and values up-projected from one kv_lora_rank latent, a rotary key shared by all heads.

    Weights: wq_a (q_lora × dim), q_norm, wq_b (heads·(nope+rope) × q_lora), or wq (heads·(nope+
    rope) × dim) when q_lora_rank is 0; wkv_a ((kv_lora + rope) × dim), kv_norm, wkv_b
    (heads·(nope+v) × kv_lora); wo (dim × heads·v). What a layer must cache per token is the
    latent and the rotary key (kv_lora + rope), one for all heads: keys and values are expanded
    per head from it.
    """
    mla, d, heads = cfg.mla, cfg.dim, cfg.n_heads
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    query, value = heads * qk, heads * mla.v_head_dim
    if mla.q_lora_rank > 0:
        q_down = d * mla.q_lora_rank + mla.q_lora_rank  # wq_a and q_norm: tp leaves them whole
        q_up = mla.q_lora_rank * query
    else:
        q_down, q_up = 0, d * query
    kv_down = d * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank
    kv_up = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    wo = value * d
    return AttentionTerms(
        kind="mla",
        heads=heads,
        query_width=query,
        key_width=query,
        value_width=value,
        output_width=value,
        params=q_down + q_up + kv_down + kv_up + wo,
        cached_width=mla.kv_lora_rank + mla.qk_rope_head_dim,
        # Context parallel gathers the keys and values expanded per head (mla.py).
        gathered_width=query + value,
        latent_width=max(mla.q_lora_rank, 0) + mla.kv_lora_rank,
        latent_norms=(mla.q_lora_rank > 0) + 1,
        replicated_params=q_down + kv_down,
    )


def mtp_depth(cfg: ModelConfig) -> int:
    """MTP modules training runs (0: none)."""
    return max(cfg.mtp.depth, 0)


def _block_params(cfg: ModelConfig, layer: int) -> tuple[int, int, int]:
    """(all parameters, those one token uses, its matmul weights) of block `layer`: MLA, two
    norms, and the dense or MoE feed-forward (n_layers + k for MTP module k's block)."""
    a = attention_terms(cfg)
    attention_matmul = a.params - a.latent_width  # the latent norms' weights are not matmuls
    if cfg.is_moe_layer(layer):
        ffn_total, ffn_active = moe_params(cfg)
    else:
        ffn_total = ffn_active = 3 * cfg.dim * cfg.ffn_hidden_dim
    norms = 2 * cfg.dim
    return (
        a.params + norms + ffn_total,
        a.params + norms + ffn_active,
        attention_matmul + ffn_active,
    )


def count_params(cfg: ModelConfig) -> ParamCount:
    """Total (MTP modules included), embedding, matmul (what one token passes: the main blocks,
    each MTP module's block and proj, and the output head once per prediction) and active
    (top_k routed experts, the router and the shared experts of each MoE block)."""
    d, depth = cfg.dim, mtp_depth(cfg)
    embedding = head = cfg.vocab_size * d
    blocks = [_block_params(cfg, i) for i in range(cfg.n_layers + depth)]
    mtp_proj = 2 * d * d
    total = embedding + (0 if cfg.tie_embeddings else head) + d  # the final norm
    total += sum(b[0] for b in blocks) + depth * (mtp_proj + 3 * d)
    active = total - sum(b[0] - b[1] for b in blocks)
    matmul = (1 + depth) * head + sum(b[2] for b in blocks) + depth * mtp_proj
    return ParamCount(total=total, embedding=embedding, matmul=matmul, active=active)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward FLOPs per trained token: 6 per matmul weight a token goes through
    (every MLA down- and up-projection, the top-k experts, each MTP module's proj, block and
    pass through the output head) plus causal attention in every block, MTP's included, over
    query/key heads of nope + rope and value heads of v_head_dim. The embedding lookup is a
    gather and is not counted."""
    mla = cfg.mla
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    attention = causal_attention_flops(seq_len, cfg.n_heads, qk, mla.v_head_dim)
    blocks = cfg.n_layers + mtp_depth(cfg)
    return 6 * count_params(cfg).matmul + blocks * attention
