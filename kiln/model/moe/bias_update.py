"""Auxiliary-loss-free load balancing (DeepSeek-V3, Wang et al. 2024): once per optimizer step,
each expert's selection bias moves by a fixed rate towards balance, by the sign of its load.

Each router counts the assignments of the step's training forwards in `tokens_per_expert`
(eval forwards, the recompute of checkpointed blocks and a pipeline schedule's shape inference
do not count, see `router.is_training_forward`); this turns the counts into bias updates and
starts the next step's counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from kiln.model.moe.router import Router


@torch.no_grad()
def update_expert_biases(
    model: nn.Module | Iterable[nn.Module],
    rate: float,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """bias_e += rate · sign(mean load − load_e) for every router of `model` (or of each model
    part), then reset the counts. `all_reduce` returns its argument summed over the ranks that
    hold the other tokens of the step (data ranks, and tensor-parallel ranks, which hold other
    parts of the same sequences), so every rank applies the same update; it is called once, with
    every router's counts stacked. rate = 0 only resets the counts.

    Returns the step's loads the update used, (routers, experts) in the order of `modules()`
    (summed by `all_reduce`), for the step's metrics; None without routers."""
    parts = [model] if isinstance(model, nn.Module) else list(model)
    routers = [m for part in parts for m in part.modules() if isinstance(m, Router)]
    if not routers:
        return None
    counts = torch.stack([router.tokens_per_expert for router in routers])
    if all_reduce is not None:
        counts = all_reduce(counts)
    if rate != 0:
        loads = counts.float()
        step = rate * torch.sign(loads.mean(dim=1, keepdim=True) - loads)
        for router, delta in zip(routers, step, strict=True):
            router.expert_bias += delta
    for router in routers:
        router.tokens_per_expert.zero_()
    return counts
