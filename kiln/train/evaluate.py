"""Held-out loss: the same first batches of the eval data every time, forward only."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from kiln.config.sections import DataConfig
from kiln.data.dataset import TokenDataset
from kiln.data.loader import BatchLoader, ShuffledSamples, Source


def eval_loader(
    dataset: TokenDataset,
    *,
    document_mask: bool,
    batch_size: int,
    grad_accum_steps: int,
    data_ranks: int,
    data_rank: int,
) -> BatchLoader:
    """Reads the held-out samples in order from the first, in batches shaped like a training
    step (micro-batches of `batch_size` per data rank), so the samples are the same whatever the
    layout."""
    source = Source("eval", ShuffledSamples(dataset, seed=0, shuffle=False), dataset.eos_id)
    return BatchLoader(
        [source],
        DataConfig(document_mask=document_mask),
        seed=0,
        batch_size=batch_size,
        grad_accum_steps=grad_accum_steps,
        data_ranks=data_ranks,
        data_rank=data_rank,
    )


@torch.no_grad()
def evaluate(
    loader: BatchLoader,
    *,
    steps: int,
    forward: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    data_group: dist.ProcessGroup | None,
    pipeline_group: dist.ProcessGroup | None,
) -> dict[str, float]:
    """`eval/loss` (mean per token over all ranks) and `eval/perplexity` over `steps` batches.
    `forward(inputs, labels)` returns the token-loss sums (zero on pipeline stages without it)
    and the valid tokens of the part of the batch this rank computed (under context parallel,
    its chunks of the sequences)."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(steps):
        for inputs, labels in loader.next_step().micro_batches:
            inputs, labels = inputs.to(device), labels.to(device)
            losses, valid = forward(inputs, labels)
            loss_sum += losses.sum()
            tokens += valid
    for value, group in ((loss_sum, pipeline_group), (loss_sum, data_group), (tokens, data_group)):
        if group is not None:
            dist.all_reduce(value, group=group)
    loss = (loss_sum / tokens.clamp(min=1)).item()
    return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 100.0))}
