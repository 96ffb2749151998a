"""Gated full attention (Qwen3-Next's softmax layers): grouped-query causal attention with per-head
q/k RMSNorms, RoPE on the first `rotary_dim` dims of each head only, and an output gate: the
query projection also makes a gate per head and its sigmoid scales the attention's output
before wo."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config.sections import ModelConfig
from kiln.model.document_mask import LayerMask, masked_attention
from kiln.model.forward_args import SequenceGathers
from kiln.model.kv_cache import prefix_causal_mask
from kiln.model.qwen3_next.norms import rms_norm
from kiln.model.rope import apply_rope, token_rows


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of each head of x (batch, heads, seq, head_dim); the
    rest pass unrotated."""
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :width], cos, sin), x[..., width:]], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = hd = cfg.resolved_head_dim
        self.gated = cfg.attention_output_gate
        # Gated: each head's rows of wq are [query | gate], as Hugging Face's q_proj lays them out.
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd * (2 if self.gated else 1), bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        zero = cfg.norm_zero_centered
        self.q_norm = rms_norm(hd, cfg.norm_eps, zero_centered=zero) if cfg.qk_norm else None
        self.k_norm = rms_norm(hd, cfg.norm_eps, zero_centered=zero) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache=None,
        layer: int = 0,
        *,
        mask: LayerMask | None = None,
        context_parallel: SequenceGathers | None = None,
    ) -> torch.Tensor:
        """x (batch, seq, dim); cos, sin the rotary tables (`rope.rope_at`'s); `cache`: a
        `GenerationCache` (state.py); `mask`: the document mask of the forward;
        `context_parallel`: attention over the whole sequences from this rank's chunks."""
        batch, seq, _ = x.shape
        start = cache.pos if cache is not None else 0
        cos, sin = token_rows(cos, sin, start=start, seq=seq)
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim * (2 if self.gated else 1))
        gate = None
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
        q = q.transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        if context_parallel is not None:
            assert mask is not None, "context parallel's mask is built from the positions"
            out = context_parallel.attend(q, k, v, mask)
        elif mask is not None:
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
        out = out.transpose(1, 2)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.wo(out.reshape(batch, seq, -1))
