"""What a forward keeps for backward, measured with saved-tensor hooks: the planner's activation
terms are held to it (tests/unit/test_plan_memory_linear.py, tests/gpu/test_delta_rule_fla.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def saved_bytes(
    forward: Callable[[], object],
    *,
    skip: Iterable[torch.Tensor] = (),
    counting: Callable[[], bool] = lambda: True,
) -> int:
    """Bytes of the distinct storages `forward()` saves for backward while `counting()` holds,
    those of `skip` (weights, the input) left out."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if counting():
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    skipped = {tensor.untyped_storage().data_ptr() for tensor in skip}
    return sum(size for ptr, size in storages.items() if ptr not in skipped)
