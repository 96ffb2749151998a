"""Building any family's model: on the meta device first, then allocated and initialized."""

from __future__ import annotations

import torch
from torch import nn

from kiln.config.sections import ModelConfig
from kiln.model.registry import family_of


def build_model(cfg: ModelConfig, *, device: torch.device | str = "meta") -> nn.Module:
    """`cfg`'s family builds the model, on the meta device unless told otherwise: no memory is
    allocated until `materialize`."""
    with torch.device(device):
        return family_of(cfg).build(cfg, None)


def materialize(model: nn.Module, *, device: torch.device | str, seed: int | None) -> nn.Module:
    """Allocate on `device` and initialize; seed=None leaves the weights empty for a checkpoint to fill."""
    model.to_empty(device=device)
    model.init_buffers()
    if seed is not None:
        model.init_weights(seed)
    return model
