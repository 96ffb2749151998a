"""Llama-3 style decoder: RMSNorm pre-norm blocks of GQA attention and SwiGLU, rotary positions."""

from __future__ import annotations

import torch
from torch import nn

from kiln.config.sections import ModelConfig
from kiln.model.decoder_block import DecoderBlock
from kiln.model.document_mask import layer_masks
from kiln.model.forward_args import SequenceGathers, StageRole
from kiln.model.init import init_decoder_weights
from kiln.model.kv_cache import KVCache
from kiln.model.llama.attention import Attention
from kiln.model.moe.balancing import AuxLossScale
from kiln.model.moe.block import MoEFeedForward
from kiln.model.output_head import output_logits, output_weight
from kiln.model.rope import model_rope_tables, rope_at


class Block(DecoderBlock):
    """A Llama block: grouped-query attention, then a SwiGLU or MoE feed-forward."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer, attention=Attention(cfg, window=cfg.attention_window(layer)))


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
        # Each layer's sliding window (0: none): the masks built from the data, one per window.
        self.windows = {i: cfg.attention_window(i) for i in self.stage.layers}
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
        inside each document; one mask serves every layer of a window. With `positions` (batch, seq) the
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
        windows = tuple(sorted(set(self.windows.values())))
        masks = layer_masks(document_ids, positions, context_parallel, windows=windows)
        cos, sin = rope_at(self.rope_cos, self.rope_sin, positions)
        h = self.tok_embeddings(x) if self.stage.first else x
        for name, block in self.layers.items():
            h = block(
                h,
                cos,
                sin,
                cache,
                int(name),
                mask=masks[self.windows[int(name)]] if masks is not None else None,
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
        return output_logits(h, self.output, self.tok_embeddings)

    def head_weight(self) -> torch.Tensor:
        """The output head's weight (vocab, dim): the embedding's when tied."""
        return output_weight(self.output, self.tok_embeddings)

    def init_buffers(self) -> None:
        """Recompute the rotary tables and zero the MoE balancing state (buffers hold garbage
        after `to_empty`)."""
        cos, sin = model_rope_tables(self.cfg, self.rope_cos.device)
        self.rope_cos, self.rope_sin = cos, sin
        for module in self.modules():
            if isinstance(module, MoEFeedForward):
                module.init_buffers()

    def init_weights(self, seed: int) -> None:
        """Depth-scaled normal init, drawn in tiles keyed by (seed, name, tile) so each rank draws
        only its shard and the full weights are the same in every layout (see `init.py`)."""
        init_decoder_weights(self, self.cfg, seed=seed)
