"""Squared gradient norms of sharded parameters, reduced across ranks in as few collectives as
possible: the global gradient norm (clipping) and the per-parameter norms (logging) both use it.

Sharded (DTensor) gradients are handled through their local parts, as plain tensors: a DTensor
op per parameter costs a sharding-propagation dispatch on the host each, which on a small model
is a visible part of the step. The partial sums of all gradients sharded over the same mesh
dimensions are reduced together, one all-reduce per such set (one under FSDP alone).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def squared_grad_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each gradient's squared L2 norm over all of its shards, in float64, as one vector.

    A gradient sharded over some mesh dimensions (Shard placements) contributes a partial sum
    that is summed over exactly those dimensions; over a Replicate dimension every rank already
    holds the whole, so nothing is summed there."""
    if not grads:
        return torch.zeros(0, dtype=torch.float64)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    # One grouped kernel launch per device and dtype, not one per gradient.
    squares = torch.stack(torch._foreach_norm(local, 2, dtype=torch.float64)).square()
    # (mesh, sharded mesh dims) -> indices of the gradients sharded that way.
    groups: dict[tuple, list[int]] = {}
    for index, grad in enumerate(grads):
        if not isinstance(grad, DTensor):
            continue
        placements = grad.placements
        if any(p.is_partial() for p in placements):
            # A pending reduction: the local part's norm means nothing; DTensor reduces first.
            norm = torch.linalg.vector_norm(grad, dtype=torch.float64).full_tensor()
            squares[index] = norm.square()
            continue
        # Every placement but Replicate splits the tensor: Shard, and _StridedShard (FSDP over
        # a tensor-parallel shard of the same dim), which is not a Shard subclass.
        sharded = tuple(dim for dim, p in enumerate(placements) if not p.is_replicate())
        if sharded:
            groups.setdefault((grad.device_mesh, sharded), []).append(index)
    for (mesh, sharded), indices in groups.items():
        partial = squares[indices]
        for dim in sharded:
            dist.all_reduce(partial, group=mesh.get_group(dim))
        squares[indices] = partial
    return squares
