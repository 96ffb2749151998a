"""Auxiliary-loss-free load balancing (DeepSeek-V3, Wang et al. 2024): once per optimizer step,
each expert's selection bias moves by a fixed rate towards balance, by the sign of its load.

Each router counts the assignments of the step's training forwards in `tokens_per_expert`
(eval forwards and the recompute of checkpointed blocks do not count, see
`router.is_training_forward`); this turns the counts into bias updates and starts the next
step's counts.
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
) -> None:
    """bias_e += rate · sign(mean load − load_e) for every router of `model` (or of each model
    part), then reset the counts. `all_reduce` returns its argument summed over the data ranks,
    so every rank applies the same update; it is called once, with every router's counts
    stacked. rate = 0 only resets the counts."""
    parts = [model] if isinstance(model, nn.Module) else list(model)
    routers = [m for part in parts for m in part.modules() if isinstance(m, Router)]
    if not routers:
        return
    if rate != 0:
        counts = torch.stack([router.tokens_per_expert for router in routers])
        if all_reduce is not None:
            counts = all_reduce(counts)
        counts = counts.float()
        step = rate * torch.sign(counts.mean(dim=1, keepdim=True) - counts)
        for router, delta in zip(routers, step, strict=True):
            router.expert_bias += delta
    for router in routers:
        router.tokens_per_expert.zero_()
