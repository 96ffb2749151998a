"""Grouped-query causal self-attention on scaled_dot_product_attention, with an optional KV cache
or a mask (attention within each packed document, or by global positions under context parallel;
see document_mask.py), a sliding window and attention sinks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.config.sections import ModelConfig
from kiln.model.document_mask import LayerMask, causal_mask, masked_attention
from kiln.model.forward_args import SequenceGathers
from kiln.model.kv_cache import KVCache, prefix_causal_mask
from kiln.model.rope import apply_rope, token_rows


class HeadSinks(nn.Module):
    """One learned logit per attention head (`weight`), split over tp ranks with the heads."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def local(self) -> torch.Tensor:
        """This rank's heads' sinks (the whole weight outside tensor parallel)."""
        return self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, window: int = 0):
        """`window`: the sliding window of this layer (0: the whole context)."""
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.resolved_head_dim,
        )
        bias = cfg.attention_bias
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.window = window
        self.sinks = HeadSinks(cfg.n_heads) if cfg.attention_sinks else None

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
        """`context_parallel`: exchanges with the cp ranks that hold the sequence's other parts
        (kiln/parallel/context_parallel.py)."""
        batch, seq, _ = x.shape
        start = cache.pos if cache is not None else 0
        cos, sin = token_rows(cos, sin, start=start, seq=seq)
        # -1 heads instead of n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        sinks = self.sinks.local() if self.sinks is not None else None
        if context_parallel is not None:
            # Its masks come from the global positions, always (kiln/model/document_mask.py).
            out = context_parallel.attend(q, k, v, mask, sinks=sinks)
        elif mask is not None or self.window or sinks is not None:
            if mask is None:  # no mask from the data: the window's (or plain causal) by shape
                keys = k.shape[2]
                mask = causal_mask(seq, keys, start=start, window=self.window, device=q.device)
            out = masked_attention(q, k, v, mask, sinks=sinks)
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
