"""Multi-token prediction (DeepSeek-V3 report, section 2.2): after the main model, depth k of D
predicts the token k + 1 ahead. Its module combines the previous depth's hidden state h^{k-1}
(the main model's last block output for k = 1) with the embedding of the token k ahead:

    h'_i = proj([RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]),  h^k = Block_k(h'),
    P^k_{i+k+1} = softmax(OutHead(RMSNorm(h^k_i))),
    L^k = CE(P^k, t_{i+k+1}) over the positions that have such a token,

sharing the main model's embedding and output head; the training loss gains
loss_weight / D · Σ_k L^k. The concatenation puts the embedding first, as the released
checkpoints' `eh_proj` does (the report writes it the other way round: the same function with
the projection's two column blocks swapped).

The tokens ahead come from the labels (labels[i] = t_{i+1}): t_{i+k} = labels[i+k-1] and the
target t_{i+k+1} = labels[i+k]; a position whose token ahead is masked or past the end has no
target. The extra loss enters the backward through `attach_aux_loss` and each depth's loss sum
and token count are kept for the step's records (`take_losses`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config.sections import ModelConfig
from kiln.model.decoder_block import DecoderBlock
from kiln.model.deepseek.mla import MultiHeadLatentAttention
from kiln.model.moe.router import is_training_forward
from kiln.tokens import IGNORE_INDEX


class MTPDepth(nn.Module):
    """One depth: the two norms, the projection back to the model width, a block, a final norm."""

    def __init__(self, cfg: ModelConfig, depth: int):
        super().__init__()
        self.embed_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.hidden_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        # Numbered after the main blocks: dense or MoE like a block of that index would be.
        layer = cfg.n_layers + depth - 1
        self.block = DecoderBlock(cfg, layer, attention=MultiHeadLatentAttention(cfg))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)


def tokens_ahead(labels: torch.Tensor, shift: int) -> torch.Tensor:
    """labels[:, i + shift] at position i, IGNORE_INDEX past the end."""
    if shift == 0:
        return labels
    pad = labels.new_full((labels.shape[0], shift), IGNORE_INDEX)
    return torch.cat([labels[:, shift:], pad], dim=1)


class MultiTokenPrediction(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = cfg.mtp.loss_weight / cfg.mtp.depth
        self.depths = nn.ModuleDict({str(k): MTPDepth(cfg, k) for k in range(1, cfg.mtp.depth + 1)})
        # Per depth: the summed token losses and the tokens counted since the last `take_losses`.
        self.register_buffer("loss_sums", torch.zeros(cfg.mtp.depth), persistent=False)
        self.register_buffer("token_counts", torch.zeros(cfg.mtp.depth), persistent=False)

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        embed: nn.Module,
        head: nn.Module,
        rope: tuple[torch.Tensor, torch.Tensor],
        block_args: dict,
    ) -> torch.Tensor:
        """The weighted sum over depths of the token-loss sums (a scalar). hidden (batch, seq,
        dim): the main model's last block output; embed, head: the main model's embedding and
        output head (modules, called as the main model calls them); rope: the (cos, sin) tables
        and block_args the keyword arguments (mask, ...) the main blocks took."""
        total = None
        for key, depth in self.depths.items():
            k = int(key)
            ahead = tokens_ahead(labels, k - 1)
            targets = tokens_ahead(labels, k).masked_fill(ahead == IGNORE_INDEX, IGNORE_INDEX)
            embedded = embed(ahead.clamp(min=0))
            joined = torch.cat([depth.embed_norm(embedded), depth.hidden_norm(hidden)], dim=-1)
            hidden = depth.block(depth.proj(joined), *rope, **block_args)
            logits = head(depth.norm(hidden))
            loss_sum = F.cross_entropy(
                logits.flatten(0, 1).float(),
                targets.flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            if is_training_forward():
                self.loss_sums[k - 1] += loss_sum.detach()
                self.token_counts[k - 1] += (targets != IGNORE_INDEX).sum()
            total = loss_sum if total is None else total + loss_sum
        return total * self.weight

    def take_losses(self) -> dict[str, torch.Tensor]:
        """{"mtp_loss_<k>": (loss sum, tokens)} since the last call, and restart the counts."""
        taken = {
            f"mtp_loss_{k + 1}": torch.stack([self.loss_sums[k], self.token_counts[k]])
            for k in range(self.loss_sums.shape[0])
        }
        self.loss_sums.zero_()
        self.token_counts.zero_()
        return taken

    def init_buffers(self) -> None:
        """Zero the loss counts (buffers hold garbage after `to_empty`)."""
        self.loss_sums.zero_()
        self.token_counts.zero_()
