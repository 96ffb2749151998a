"""Global gradient norm, accumulated in float64, and clipping to it.

fp32 norms of large, skewed gradients (the output head's: a few big entries, many tiny ones) are
off by ~1e-4 relative, and by a different amount in every layout; float64 accumulation makes the
logged norm a layout-independent number that parity tests can compare at 1e-5. The reduction of sharded gradients is in
`kiln/parallel/grad_norms.py`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kiln.parallel.grad_norms import squared_grad_norms


def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    *,
    pipeline_group: dist.ProcessGroup | None = None,
    duplicates: Iterable[torch.nn.Parameter] = (),
) -> torch.Tensor:
    """Return the global L2 norm of the gradients; scale them down to `max_norm` if above (0: never).

    Under pipeline parallel each rank holds some stages: their squared norms are summed over
    `pipeline_group`. `duplicates` (a second copy of a tied weight) are clipped but not counted.
    """
    params = [p for p in parameters if p.grad is not None]
    skip = {id(p) for p in duplicates}
    squared = squared_grad_norms([p.grad for p in params if id(p) not in skip]).sum()
    if pipeline_group is not None:
        dist.all_reduce(squared, group=pipeline_group)
    total = squared.sqrt()
    if max_norm > 0 and params:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0).float()
        # Scaling is elementwise: each rank scales its own shard, no DTensor dispatch needed.
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        torch._foreach_mul_(local, coef)
    return total
