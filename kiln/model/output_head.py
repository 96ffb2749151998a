"""The output head of a decoder whose embedding may be tied to it: the logits and the weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


def output_logits(
    h: torch.Tensor, output: nn.Linear | None, embedding: nn.Embedding | None
) -> torch.Tensor:
    """Logits of the final norm's output `h`: through `output`, or, tied (no `output`), through
    the embedding's weight. Under tensor parallel the tied head gathers the sequence and keeps
    the vocabulary split, as the untied head's plan does."""
    if output is not None:
        return output(h)
    if isinstance(h, DTensor):
        h = h.redistribute(placements=[Replicate()] * h.device_mesh.ndim)
    return F.linear(h, embedding.weight)


def output_weight(output: nn.Linear | None, embedding: nn.Embedding | None) -> torch.Tensor:
    """The output head's weight (vocab, dim): the embedding's when tied. Read it after the
    forward, never kept: FSDP swaps the parameters between sharded and gathered."""
    return embedding.weight if output is None else output.weight
