"""Token losses as sums; the trainer divides by the global count of valid tokens (DESIGN §4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.tokens import IGNORE_INDEX


def token_loss_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    z_loss_weight: float = 0.0,
    per_row: bool = False,
) -> torch.Tensor:
    """Sum over valid tokens of cross entropy (+ z_loss_weight · logsumexp², which keeps logits
    from drifting); with `per_row`, one sum per sequence (batch,), e.g. to split it by dataset."""
    rows = labels.shape[0]
    logits = logits.flatten(0, -2).float()
    labels = labels.flatten()
    reduction = "none" if per_row else "sum"
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction=reduction)
    if z_loss_weight > 0:
        z = torch.logsumexp(logits, dim=-1).square() * (labels != IGNORE_INDEX)
        loss = loss + z_loss_weight * (z if per_row else z.sum())
    return loss.view(rows, -1).sum(dim=1) if per_row else loss


def count_valid_per_row(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum(dim=1)


def count_valid(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
