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
target t_{i+k+1} = labels[i+k]. Depth k's target at i depends on labels[i..i+k] (each depth's
token ahead up to k, through h^{k-1}_i, and the target itself), and counts only when none of
them is masked or past the end. Under data.document_mask a masked label marks a document
boundary, so no depth predicts across one; the placeholder id embedded for a masked token
ahead reaches no target that counts (attention keeps to the document, and its later positions
have the same masked label in their chains). Under context parallel a rank holds chunks of
each sequence, and the tokens ahead of its last positions sit on another rank: the model takes
the whole sequences' labels and reads them at its global positions. The extra loss enters the
backward through `attach_aux_loss`, and each depth's loss sum and token count are kept for the
step's records (`take_losses`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.config.sections import ModelConfig
from kiln.model.decoder_block import DecoderBlock
from kiln.model.deepseek.mla import MultiHeadLatentAttention
from kiln.model.moe.router import is_training_forward
from kiln.tokens import IGNORE_INDEX


def _local(loss: torch.Tensor) -> torch.Tensor:
    # Under tensor parallel the head's logits are split over the vocabulary and the cross
    # entropy (loss parallel) returns the whole sum as a replicated DTensor: every tp rank's
    # local value is that sum, and its backward hands the vocabulary-split logits their part.
    return loss.to_local() if isinstance(loss, DTensor) else loss


class MTPDepth(nn.Module):
    """One depth: the two norms, the projection back to the model width, a block, a final norm.
    The family's parallel plan treats it as a block (kiln/model/deepseek/plan.py)."""

    def __init__(self, cfg: ModelConfig, depth: int):
        super().__init__()
        self.embed_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.hidden_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        # Numbered after the main blocks: dense or MoE like a block of that index would be.
        self.layer = cfg.n_layers + depth - 1
        self.block = DecoderBlock(cfg, self.layer, attention=MultiHeadLatentAttention(cfg))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(
        self, hidden: torch.Tensor, embedded: torch.Tensor, cos, sin, **block_args
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h^k, RMSNorm(h^k)) from h^{k-1} and the embedded tokens ahead, (batch, seq, dim)."""
        joined = torch.cat([self.embed_norm(embedded), self.hidden_norm(hidden)], dim=-1)
        hidden = self.block(self.proj(joined), cos, sin, **block_args)
        return hidden, self.norm(hidden)


def tokens_ahead(labels: torch.Tensor, positions: torch.Tensor, shift: int) -> torch.Tensor:
    """labels[b, positions[b, i] + shift] at (b, i), IGNORE_INDEX past the end. `labels` holds
    whole sequences; `positions` the positions this rank computes (all of them, or its chunks
    under context parallel, whose tokens ahead may sit on another rank)."""
    index = positions + shift
    past_end = index >= labels.shape[1]
    ahead = labels.gather(1, index.clamp(max=labels.shape[1] - 1))
    return ahead.masked_fill(past_end, IGNORE_INDEX)


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
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The weighted sum over depths of the token-loss sums (a scalar). hidden (batch, seq,
        dim): the main model's last block output; labels (batch, whole seq): the labels of the
        whole sequences; positions (batch, seq): the positions of `hidden`'s tokens, None for
        all in order; embed, head: the main model's embedding and output head (modules, called
        as the main model calls them); rope: the (cos, sin) tables and block_args the keyword
        arguments (mask, ...) the main blocks took."""
        if positions is None:
            positions = torch.arange(labels.shape[1], device=labels.device).expand_as(labels)
        total, broken = None, torch.zeros_like(positions, dtype=torch.bool)
        for key, depth in self.depths.items():
            k = int(key)
            ahead = tokens_ahead(labels, positions, k - 1)
            broken = broken | (ahead == IGNORE_INDEX)  # a masked label in labels[i..i+k-1]
            targets = tokens_ahead(labels, positions, k).masked_fill(broken, IGNORE_INDEX)
            hidden, normed = depth(hidden, embed(ahead.clamp(min=0)), *rope, **block_args)
            loss_sum = _local(
                F.cross_entropy(
                    head(normed).flatten(0, 1).float(),
                    targets.flatten(),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
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
