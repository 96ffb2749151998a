"""The pre-norm decoder block the families share; a family brings its attention module."""

from __future__ import annotations

import torch
from torch import nn

from kiln.config.sections import ModelConfig
from kiln.model.document_mask import LayerMask
from kiln.model.feed_forward import FeedForward
from kiln.model.forward_args import SequenceGathers
from kiln.model.kv_cache import KVCache
from kiln.model.moe.balancing import AuxLossScale
from kiln.model.moe.block import MoEFeedForward


class DecoderBlock(nn.Module):
    """attention_norm -> attention -> residual, ffn_norm -> feed-forward -> residual; the
    feed-forward is dense or Mixture-of-Experts by `cfg.is_moe_layer(layer)`."""

    def __init__(self, cfg: ModelConfig, layer: int, *, attention: nn.Module):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = attention
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        # One attribute for both kinds, so parameter names read layers.{i}.feed_forward.*.
        self.feed_forward = (
            MoEFeedForward(cfg)
            if cfg.is_moe_layer(layer)
            else FeedForward(cfg.dim, cfg.ffn_hidden_dim)
        )

    def forward(
        self,
        x,
        cos,
        sin,
        cache: KVCache | None = None,
        layer: int = 0,
        *,
        mask: LayerMask | None = None,
        context_parallel: SequenceGathers | None = None,
        moe_scale: AuxLossScale | None = None,
    ) -> torch.Tensor:
        # The mask and the rest go by keyword: tensor parallel's PrepareModuleInput lays out the
        # positional arguments of attention and passes keywords through untouched.
        h = self.attention_norm(x)
        x = x + self.attention(
            h, cos, sin, cache, layer, mask=mask, context_parallel=context_parallel
        )
        h = self.ffn_norm(x)
        if isinstance(self.feed_forward, MoEFeedForward):
            return x + self.feed_forward(h, scale=moe_scale)
        return x + self.feed_forward(h)
