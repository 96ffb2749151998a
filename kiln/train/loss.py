"""Token losses as sums; the trainer divides by the global count of valid tokens (DESIGN §4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, *, z_loss_weight: float = 0.0
) -> torch.Tensor:
    """Sum over valid tokens of cross entropy (+ z_loss_weight · logsumexp², which keeps logits from drifting)."""
    logits = logits.flatten(0, -2).float()
    labels = labels.flatten()
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    if z_loss_weight > 0:
        valid = labels != IGNORE_INDEX
        z = torch.logsumexp(logits, dim=-1)
        loss = loss + z_loss_weight * (z.square() * valid).sum()
    return loss


def count_valid(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
