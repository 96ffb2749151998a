"""Optimizer construction: AdamW, weight decay on matrices only, fused kernels where they exist."""

from __future__ import annotations

import torch
from torch import nn

from kiln.config.sections import OptimizerConfig


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # Norm gains (1-D) are scales, not features: decaying them toward 0 only hurts.
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    on_cuda = all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        fused=True if on_cuda else None,
        foreach=None if on_cuda else True,
    )
