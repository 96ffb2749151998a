"""FSDP2 (`fully_shard`) per sub-module: attention and MLP as their own units inside each block.

Separate units for attention and MLP mean only one of them is unsharded at a time, which the
seeds measured as 11% less peak memory and far less allocator pressure than whole-block units.
A 2-D mesh (dp_replicate, dp_shard) gives HSDP: shard within a replica, all-reduce across.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

# Test-only: leave FSDP's gradient average in place, the classic silent mistake (a loss curve that
# looks fine, gradients divided by the data-parallel size). The parity tests must catch it.
BREAK_GRADIENT_SUM_FOR_TESTS = "KILN_TEST_AVERAGE_GRADIENTS"


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, bf16: bool, pipelined: bool = False) -> None:
    """Shard `model` (or one pipeline stage of it). A pipelined stage keeps its blocks gathered
    between forward and backward: resharding would all-gather again for every micro-batch."""
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for block in model.layers.values():
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        for unit in (inner.attention, inner.feed_forward, block):
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=not pipelined)
    # The root unit holds embeddings, final norm and output head; it is gathered for the whole
    # step anyway, so it is not resharded after forward.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def gradient_average_compensation(mesh: DeviceMesh | None) -> int:
    """FSDP averages gradients over its ranks; the loss is already divided by the global token
    count, so gradients must be summed (DESIGN §4). Scaling the loss by the rank count undoes the
    average on every backend (gloo has no PREMUL_SUM for `set_gradient_divide_factor`)."""
    if mesh is None or os.environ.get(BREAK_GRADIENT_SUM_FOR_TESTS) == "1":
        return 1
    return mesh.size()
