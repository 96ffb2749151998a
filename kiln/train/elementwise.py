"""Elementwise optimizers (Lion, Schedule-Free AdamW) update each rank's local shard of a DTensor
weight: an elementwise update of the shards is the update of the whole tensor, in any layout."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank holds (a view: in-place updates reach the DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of `param`'s gradient, laid out like its part of `param` (a gradient left
    as a pending sum or in another placement is brought to the weight's first)."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local(grad)
