"""Llama-3 style decoder: RMSNorm pre-norm blocks of GQA attention and SwiGLU, rotary positions."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from kiln.config.sections import ModelConfig
from kiln.model.document_mask import DocumentMask, build_document_mask, build_position_mask
from kiln.model.feed_forward import FeedForward
from kiln.model.forward_args import SequenceGathers, StageRole
from kiln.model.init import fill_normal_
from kiln.model.kv_cache import KVCache
from kiln.model.llama.attention import Attention
from kiln.model.moe.balancing import AuxLossScale
from kiln.model.moe.block import MoEFeedForward
from kiln.model.names import canonical_name
from kiln.model.rope import model_rope_tables


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
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
        mask: DocumentMask | None = None,
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


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, stage: StageRole | None = None):
        super().__init__()
        self.cfg = cfg
        self.stage = stage if stage is not None else StageRole.whole(cfg.n_layers)
        first, last, tied = self.stage.first, self.stage.last, cfg.tie_embeddings
        # Tied: the last stage keeps its own copy of the embedding as output head. Tied embeddings
        # reuse tok_embeddings.weight in forward instead of sharing a Parameter, which `to_empty`
        # and sharding would silently untie.
        held = first or (last and tied)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim) if held else None
        # A dict keyed by layer index keeps parameter names those of the whole model in a stage.
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in self.stage.layers})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps) if last else None
        head = last and not tied
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if head else None
        cos, sin = model_rope_tables(cfg, device=None)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        *,
        document_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        context_parallel: SequenceGathers | None = None,
        apply_head: bool = True,
        moe_scale: AuxLossScale | None = None,
    ) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab).

        With `document_ids` (batch, seq) (see `document_mask.document_ids`), attention stays
        inside each document; one mask serves every layer. With `positions` (batch, seq) the
        tokens sit at those positions of their sequences (context parallel: some chunks of each
        sequence; RoPE and the causal mask go by them).

        A pipeline stage (`self.stage`) holds some of the layers: a stage after the first takes
        the previous stage's hidden states instead of tokens, and a stage before the last returns
        hidden states instead of logits. Without `apply_head` the (last) stage returns the final
        norm's output, to which the loss applies `head_weight()` itself (the chunked loss).
        `context_parallel`: the gathers of the sequence's other parts (kiln/parallel/
        context_parallel.py); `moe_scale`: the step's normalization of the MoE auxiliary losses.
        """
        if cache is not None and (document_ids is not None or positions is not None):
            raise ValueError(
                "a KV cache (generation) runs whole sequences in order in one process: "
                "document_ids and positions (context parallel) cannot be combined with it"
            )
        mask = self._attention_mask(document_ids, positions, context_parallel)
        cos, sin = self.rope_cos, self.rope_sin
        if positions is not None:
            # (batch, 1, seq, head_dim): broadcast over the heads.
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        h = self.tok_embeddings(x) if self.stage.first else x
        for name, block in self.layers.items():
            h = block(
                h,
                cos,
                sin,
                cache,
                int(name),
                mask=mask,
                context_parallel=context_parallel,
                moe_scale=moe_scale,
            )
        if cache is not None:
            cache.advance(x.shape[1])
        if not self.stage.last:
            return h
        h = self.norm(h)
        if not apply_head:
            return h
        if self.output is None:
            if isinstance(h, DTensor):  # tensor parallel: gather the sequence, keep the vocab split
                h = h.redistribute(placements=[Replicate()] * h.device_mesh.ndim)
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    def _attention_mask(
        self,
        document_ids: torch.Tensor | None,
        positions: torch.Tensor | None,
        context_parallel: SequenceGathers | None,
    ) -> DocumentMask | None:
        """The mask every layer shares; None: plain causal attention over whole sequences."""
        if positions is None:
            return build_document_mask(document_ids) if document_ids is not None else None
        key_positions, key_ids = positions, document_ids
        if context_parallel is not None:  # the keys are the whole sequence's
            key_positions = context_parallel.gather_sequence(positions)
            if document_ids is not None:
                key_ids = context_parallel.gather_sequence(document_ids)
        return build_position_mask(positions, key_positions, ids=document_ids, key_ids=key_ids)

    def head_weight(self) -> torch.Tensor:
        """The output head's weight (vocab, dim): the embedding's when tied. Read it after the
        forward, never kept: FSDP swaps the parameters between sharded and gathered."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def init_buffers(self) -> None:
        """Recompute the rotary tables and zero the MoE balancing state (buffers hold garbage
        after `to_empty`)."""
        cos, sin = model_rope_tables(self.cfg, self.rope_cos.device)
        self.rope_cos, self.rope_sin = cos, sin
        for module in self.modules():
            if isinstance(module, MoEFeedForward):
                module.init_buffers()

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Depth-scaled normal init, drawn in tiles keyed by (seed, name, tile) so each rank draws
        only its shard and the full weights are the same in every layout (see `init.py`)."""
        for wrapped_name, param in self.named_parameters():
            name = canonical_name(wrapped_name)
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                fill_normal_(param, std=init_std(self.cfg, name), seed=seed, name=name)


def init_std(cfg: ModelConfig, name: str) -> float:
    """Standard deviation of the normal init of parameter `name` (canonical, without wrappers)."""
    if name == "tok_embeddings.weight" and not cfg.tie_embeddings:
        # Unit-scale embeddings put the residual stream at O(1) from the start; at init_std,
        # every Adam step would move them by a large fraction of their size.
        return 1.0
    if name.endswith(
        (
            "attention.wo.weight",
            "feed_forward.w2.weight",
            "feed_forward.shared_experts.w2.weight",
            "feed_forward.experts.w2",
        )
    ):
        # Outputs written into the residual stream shrink with depth, so it does not grow.
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std
