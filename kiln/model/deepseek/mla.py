"""Multi-head latent attention (DeepSeek-V2/V3): queries through a low-rank latent, keys and values
expanded per head from one shared latent, and a rotary part of query and key kept apart from the
rest, its key part one for all heads. The softmax runs on SDPA or flex attention like the Llama
family's, with a document mask or by positions under context parallel (document_mask.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config.sections import ModelConfig
from kiln.model.document_mask import LayerMask, masked_attention
from kiln.model.forward_args import SequenceGathers
from kiln.model.kv_cache import KVCache, prefix_causal_mask
from kiln.model.rope import apply_rope, token_rows, yarn_mscale

# DeepSeek's code (its own and transformers') builds the query and key-value latent norms without
# an eps argument: 1e-6, whatever rms_norm_eps (model.norm_eps, the blocks' norms) says.
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: ModelConfig) -> float:
    """1 / sqrt(query width), times YaRN's mscale_all_dim correction squared when stretched."""
    width = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
    scale = width**-0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_yarn_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_scaling_factor, cfg.rope_yarn_mscale_all_dim) ** 2
    return scale


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.mla
        self.nope, self.rope, self.value = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kv_rank, self.scale = m.kv_lora_rank, softmax_scale(cfg)
        query_width = cfg.n_heads * (self.nope + self.rope)
        self.low_rank_query = m.q_lora_rank > 0
        if self.low_rank_query:
            self.wq_a = nn.Linear(cfg.dim, m.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(m.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(m.q_lora_rank, query_width, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, query_width, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, m.kv_lora_rank + self.rope, bias=False)
        # The rotary key every head shares, as a module: tensor parallel sums its gradient over
        # the ranks' heads here (plan.py), since it reaches no head-split projection.
        self.shared_rope_key = nn.Identity()
        self.kv_norm = nn.RMSNorm(m.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(m.kv_lora_rank, cfg.n_heads * (self.nope + self.value), bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.value, cfg.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        *,
        mask: LayerMask | None = None,
        context_parallel: SequenceGathers | None = None,
    ) -> torch.Tensor:
        """x (batch, seq, dim) -> (batch, seq, dim); the arguments as the Llama family's."""
        batch, seq, _ = x.shape
        start = cache.pos if cache is not None else 0
        cos, sin = token_rows(cos, sin, start=start, seq=seq)
        query = self.wq_b(self.q_norm(self.wq_a(x))) if self.low_rank_query else self.wq(x)
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        query = query.view(batch, seq, -1, self.nope + self.rope)
        q_nope, q_rope = query.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        keys_values = self.wkv_b(self.kv_norm(latent))
        keys_values = keys_values.view(batch, seq, -1, self.nope + self.value).transpose(1, 2)
        k_nope, v = keys_values.split([self.nope, self.value], dim=-1)
        # A copy of its own: attention keeps v for the backward, and as a view it would keep
        # wkv_b's whole output alive, the non-rotary keys (already copied into k) included.
        v = v.contiguous()
        # One rotary key (batch, 1, seq, rope) for all heads.
        k_rope = apply_rope(self.shared_rope_key(k_rope).unsqueeze(1), cos, sin)
        # The query is joined in (batch, seq, heads, width) and handed on transposed: flex
        # attention (the CUDA path) returns its output in the query's stride order, which then
        # goes into wo without a copy.
        q_rope = apply_rope(q_rope.transpose(1, 2), cos, sin).transpose(1, 2)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        if context_parallel is not None:
            out = context_parallel.attend(q, k, v, mask, scale=self.scale)
        elif mask is not None:
            out = masked_attention(q, k, v, mask, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=prefix_causal_mask(seq, start, q.device),
                is_causal=start == 0,
                scale=self.scale,
            )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
