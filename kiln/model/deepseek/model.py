"""DeepSeek-V3 style decoder: pre-norm blocks of multi-head latent attention and a dense (first
blocks) or Mixture-of-Experts feed-forward, YaRN-scaled rotary positions on the rotary part,
and multi-token prediction modules after the last block while training (mtp.py)."""

from __future__ import annotations

import torch
from torch import nn

from kiln.config.sections import ModelConfig
from kiln.model.decoder_block import DecoderBlock
from kiln.model.deepseek.mla import MultiHeadLatentAttention
from kiln.model.deepseek.mtp import MultiTokenPrediction
from kiln.model.document_mask import layer_masks
from kiln.model.forward_args import LossScale, SequenceGathers, StageRole
from kiln.model.init import init_decoder_weights
from kiln.model.kv_cache import KVCache
from kiln.model.moe.balancing import AuxLossScale, attach_aux_loss
from kiln.model.moe.block import MoEFeedForward
from kiln.model.rope import model_rope_tables, rope_at


class Transformer(nn.Module):
    # The training step passes `labels` and `loss_scale` to a model that adds losses of its own.
    adds_losses = True

    def __init__(self, cfg: ModelConfig, stage: StageRole | None = None):
        super().__init__()
        self.cfg = cfg
        self.stage = stage if stage is not None else StageRole.whole(cfg.n_layers)
        first, last = self.stage.first, self.stage.last
        with_mtp = last and cfg.mtp.depth > 0
        # The multi-token prediction modules embed the tokens ahead with the main embedding.
        held = first or with_mtp
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim) if held else None
        self.layers = nn.ModuleDict(
            {
                str(i): DecoderBlock(cfg, i, attention=MultiHeadLatentAttention(cfg))
                for i in self.stage.layers
            }
        )
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps) if last else None
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if last else None
        self.mtp = MultiTokenPrediction(cfg) if with_mtp else None
        cos, sin = model_rope_tables(cfg, device=None, width=cfg.mla.qk_rope_head_dim)
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
        labels: torch.Tensor | None = None,
        loss_scale: LossScale | None = None,
    ) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab); the arguments as the Llama
        family's (kiln/model/llama/model.py). With `labels` (batch, whole seq: under context
        parallel the whole sequences' labels, not this rank's chunks) and `loss_scale` (the
        factor the step's backward puts on token-loss sums) in training, the multi-token
        prediction losses join the backward; without them (eval, generation, export) the MTP
        modules do not run."""
        if cache is not None and (document_ids is not None or positions is not None):
            raise ValueError(
                "a KV cache (generation) runs whole sequences in order in one process: "
                "document_ids and positions (context parallel) cannot be combined with it"
            )
        masks = layer_masks(document_ids, positions, context_parallel)  # no windows here
        mask = masks[0] if masks is not None else None
        cos, sin = rope_at(self.rope_cos, self.rope_sin, positions)
        block_args = {
            "mask": mask,
            "context_parallel": context_parallel,
            "moe_scale": moe_scale,
        }
        h = self.tok_embeddings(x) if self.stage.first else x
        for name, block in self.layers.items():
            h = block(h, cos, sin, cache, int(name), **block_args)
        if cache is not None:
            cache.advance(x.shape[1])
        if not self.stage.last:
            return h
        out = self.norm(h)
        if apply_head:
            out = self.output(out)
        if self.mtp is not None and labels is not None and loss_scale is not None:
            extra = self.mtp(
                h,
                labels,
                positions=positions,
                embed=self.tok_embeddings,
                head=self.output,
                rope=(cos, sin),
                block_args=block_args,
            )
            out = attach_aux_loss(out, extra * loss_scale.per_token)
        return out

    def head_weight(self) -> torch.Tensor:
        """The output head's weight (vocab, dim). Read it after the forward, never kept: FSDP
        swaps the parameters between sharded and gathered."""
        return self.output.weight

    def loss_names(self) -> list[str]:
        """The names of the model's own losses, the same on every pipeline stage."""
        return [f"mtp_loss_{k}" for k in range(1, self.cfg.mtp.depth + 1)]

    def take_losses(self) -> dict[str, torch.Tensor]:
        """The model's own losses since the last call, {name: (loss sum, tokens)}; none on a
        stage without the multi-token prediction modules."""
        return self.mtp.take_losses() if self.mtp is not None else {}

    def init_buffers(self) -> None:
        """Recompute the rotary tables and zero the balancing and loss counts (buffers hold
        garbage after `to_empty`)."""
        width = self.cfg.mla.qk_rope_head_dim
        self.rope_cos, self.rope_sin = model_rope_tables(
            self.cfg, self.rope_cos.device, width=width
        )
        for module in self.modules():
            if isinstance(module, (MoEFeedForward, MultiTokenPrediction)):
                module.init_buffers()

    def init_weights(self, seed: int) -> None:
        """Depth-scaled normal init in tiles, the same in every layout (kiln/model/init.py)."""
        init_decoder_weights(self, self.cfg, seed=seed)
