"""Small collectives the training step needs, and telling a failed collective from other errors."""

from __future__ import annotations

import torch
import torch.distributed as dist


def sum_over(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`value` summed over `group` (None: this rank alone), leaving the input untouched."""
    if group is None:
        return value
    value = value.clone()
    dist.all_reduce(value, group=group)
    return value


def is_collective_failure(error: BaseException) -> bool:
    """A collective that failed because a peer died, hung or closed its connection."""
    text = str(error).lower()
    return isinstance(error, dist.DistError) or any(
        word in text for word in ("gloo", "nccl", "connection closed", "timed out", "socket")
    )
