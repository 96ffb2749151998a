"""The hybrid decoder (Qwen3-Next, Qwen3.5): pre-norm blocks whose token mixer is a Gated DeltaNet
(linear attention) or a gated full attention layer, by model.layer_types, then a dense SwiGLU or
kiln's Mixture of Experts; partial rotary positions in the full-attention layers only."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.config.sections import ModelConfig
from kiln.model.document_mask import LayerMask, layer_masks
from kiln.model.feed_forward import FeedForward
from kiln.model.forward_args import SequenceGathers, StageRole
from kiln.model.init import init_decoder_weights, shard_regions, tile_seed
from kiln.model.moe.balancing import AuxLossScale
from kiln.model.moe.block import MoEFeedForward
from kiln.model.names import canonical_name
from kiln.model.output_head import output_logits, output_weight
from kiln.model.qwen3_next.attention import GatedAttention
from kiln.model.qwen3_next.context_parallel import ChunkLinks, chunk_links
from kiln.model.qwen3_next.delta_rule import document_starts
from kiln.model.qwen3_next.gated_deltanet import GatedDeltaNet
from kiln.model.qwen3_next.norms import rms_norm
from kiln.model.qwen3_next.state import GenerationCache
from kiln.model.rope import model_rope_tables, rope_at

# A_log = log(A), A drawn uniform in this range (Mamba-2's; the decay per step is
# exp(−A·softplus(a + dt_bias))).
A_INIT_RANGE = (1.0, 16.0)


class Block(nn.Module):
    """attention_norm -> Gated DeltaNet (`linear_attention`) or gated attention (`attention`) ->
    residual, ffn_norm -> feed-forward (dense or MoE by `cfg.is_moe_layer(layer)`) -> residual."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        zero = cfg.norm_zero_centered
        self.attention_norm = rms_norm(cfg.dim, cfg.norm_eps, zero_centered=zero)
        self.linear = cfg.is_linear_attention_layer(layer)
        if self.linear:
            self.linear_attention = GatedDeltaNet(cfg)
        else:
            self.attention = GatedAttention(cfg)
        self.ffn_norm = rms_norm(cfg.dim, cfg.norm_eps, zero_centered=zero)
        self.feed_forward = (
            MoEFeedForward(cfg)
            if cfg.is_moe_layer(layer)
            else FeedForward(cfg.dim, cfg.ffn_hidden_dim)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: GenerationCache | None = None,
        layer: int = 0,
        *,
        mask: LayerMask | None = None,
        starts: torch.Tensor | None = None,
        links: ChunkLinks | None = None,
        context_parallel: SequenceGathers | None = None,
        moe_scale: AuxLossScale | None = None,
    ) -> torch.Tensor:
        # Everything but the input by keyword where tensor parallel lays out the inputs: its
        # PrepareModuleInput passes keywords through untouched.
        h = self.attention_norm(x)
        if self.linear:
            h = self.linear_attention(
                h, cache=cache, layer=layer, document_starts=starts, links=links
            )
        else:
            h = self.attention(
                h, cos, sin, cache, layer, mask=mask, context_parallel=context_parallel
            )
        x = x + h
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
        # Tied: the last stage keeps its own copy of the embedding as output head, used in
        # forward rather than shared as a Parameter (which `to_empty` and sharding would untie).
        held = first or (last and tied)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim) if held else None
        # A dict keyed by layer index keeps parameter names those of the whole model in a stage.
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in self.stage.layers})
        self.norm = (
            rms_norm(cfg.dim, cfg.norm_eps, zero_centered=cfg.norm_zero_centered) if last else None
        )
        head = last and not tied
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if head else None
        cos, sin = model_rope_tables(cfg, device=None, width=cfg.rotary_dim)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        cache: GenerationCache | None = None,
        *,
        document_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        context_parallel: SequenceGathers | None = None,
        apply_head: bool = True,
        moe_scale: AuxLossScale | None = None,
    ) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab); the arguments as the Llama
        family's (kiln/model/llama/model.py). With `document_ids` the full-attention layers
        attend within each document and the Gated DeltaNet layers start afresh at each
        document's first token. Under context parallel (`positions`, `context_parallel`) the
        full-attention layers attend over the whole sequences as the Llama family's do, and the
        Gated DeltaNet layers hand their chunks' convolution inputs and states on
        (context_parallel.py)."""
        if cache is not None and (document_ids is not None or positions is not None):
            raise ValueError(
                "a generation cache runs whole sequences in order in one process: "
                "document_ids and positions (context parallel) cannot be combined with it"
            )
        blocks = list(self.layers.values())
        masks = None
        if any(not block.linear for block in blocks):
            masks = layer_masks(document_ids, positions, context_parallel)
        starts = document_starts(document_ids) if document_ids is not None else None
        links = None
        if positions is not None:
            assert context_parallel is not None, "positions without context parallel's gathers"
            links = chunk_links(
                context_parallel,
                positions,
                document_ids,
                conv_kernel=self.cfg.linear_attention.conv_kernel,
            )
            starts = links.starts
        cos, sin = rope_at(self.rope_cos, self.rope_sin, positions)
        h = self.tok_embeddings(x) if self.stage.first else x
        for name, block in self.layers.items():
            h = block(
                h,
                cos,
                sin,
                cache,
                int(name),
                mask=masks[0] if masks is not None else None,
                starts=starts,
                links=links,
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

    def generation_cache(
        self, *, batch: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> GenerationCache:
        """The state generation carries between forwards (kiln/model/generate.py)."""
        return GenerationCache(self.cfg, batch=batch, max_len=max_len, device=device, dtype=dtype)

    def init_buffers(self) -> None:
        """Recompute the rotary tables and zero the MoE balancing state (buffers hold garbage
        after `to_empty`)."""
        self.rope_cos, self.rope_sin = model_rope_tables(
            self.cfg, self.rope_cos.device, width=self.cfg.rotary_dim
        )
        for module in self.modules():
            if isinstance(module, MoEFeedForward):
                module.init_buffers()

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """kiln's decoder init (kiln/model/init.py: norms 1, matrices normal in tiles, the same
        in every layout), then the family's own: zero-centred norms 0 (a gain of 1), A_log =
        log(uniform(1, 16)) drawn from a generator of (seed, name), dt_bias 1 (Hugging Face's);
        the Gated DeltaNet's gated norm stays at 1."""
        init_decoder_weights(self, self.cfg, seed=seed)
        for wrapped_name, param in self.named_parameters():
            name = canonical_name(wrapped_name)
            if name.endswith("linear_attention.A_log"):
                generator = torch.Generator().manual_seed(tile_seed(seed, name, (0,)))
                drawn = torch.empty(param.shape).uniform_(*A_INIT_RANGE, generator=generator)
                _copy_whole(param, drawn.log())
            elif name.endswith("linear_attention.dt_bias"):
                param.fill_(1.0)
            elif (
                self.cfg.norm_zero_centered
                and name.endswith("norm.weight")
                and not name.endswith("linear_attention.norm.weight")
            ):
                param.zero_()


def _copy_whole(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy into `param` (a tensor or this rank's DTensor shard) its part of `whole`."""
    if not isinstance(param, DTensor):
        param.copy_(whole)
        return
    coordinate = param.device_mesh.get_coordinate()
    if coordinate is None:  # this rank holds no part of the tensor
        return
    mesh = tuple(param.device_mesh.shape)
    local = param.to_local()
    for into, offset, shape in shard_regions(
        tuple(param.shape), mesh, coordinate, param.placements
    ):
        part = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        local[into].copy_(whole[part])
