"""Global gradient norm, accumulated in float64, and clipping to it.

fp32 norms of large, skewed gradients (the output head's: a few big entries, many tiny ones) are
off by ~1e-4 relative, and by a different amount in every layout; float64 accumulation makes the
logged norm a layout-independent number that parity tests can compare at 1e-5.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Return the global L2 norm of the gradients; scale them down to `max_norm` if above (0: never)."""
    params = [p for p in parameters if p.grad is not None]
    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in params]
    # Norms of sharded gradients are partial; full_tensor() reduces them across ranks.
    total = torch.linalg.vector_norm(torch.stack(norms))
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0).float()
        for p in params:
            p.grad.mul_(coef)
    return total
