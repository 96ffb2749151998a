"""Grouped-query causal self-attention on scaled_dot_product_attention, with an optional KV cache
or a mask (attention within each packed document, or by global positions under context parallel;
see document_mask.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config.sections import ModelConfig
from kiln.model.document_mask import DocumentMask, masked_attention
from kiln.model.forward_args import SequenceGathers
from kiln.model.kv_cache import KVCache, prefix_causal_mask
from kiln.model.rope import apply_rope


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.resolved_head_dim,
        )
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        *,
        mask: DocumentMask | None = None,
        context_parallel: SequenceGathers | None = None,
    ) -> torch.Tensor:
        """`context_parallel`: gathers the keys and values of the sequence's other parts, held
        by the other cp ranks (kiln/parallel/context_parallel.py)."""
        batch, seq, _ = x.shape
        start = cache.pos if cache is not None else 0
        if cos.ndim == 2:
            # Full tables in, sliced here: under sequence parallel only attention sees whole
            # sequences. Tables for given positions (context parallel) come indexed already.
            cos, sin = cos[start : start + seq], sin[start : start + seq]
        # -1 heads instead of n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        if context_parallel is not None:
            k, v = context_parallel.gather_kv(k, v)
        if mask is not None:
            out = masked_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=prefix_causal_mask(seq, start, q.device),
                is_causal=start == 0,
                enable_gqa=True,
            )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
