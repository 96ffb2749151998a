"""FSDP2 (`fully_shard`) per sub-module: the units the model's plan names inside each block (for
Llama attention and MLP), then the block, then the root.

Separate units for attention and MLP mean only one of them is unsharded at a time, which the
seeds measured as 11% less peak memory and far less allocator pressure than whole-block units.
A 2-D mesh (dp_replicate, dp_shard) gives HSDP: shard within a replica, all-reduce across.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from kiln.model.parallel_plan import ParallelPlan
from kiln.parallel.mutations import mutation_on


def apply_fsdp(
    model: nn.Module,
    plan: ParallelPlan,
    mesh: DeviceMesh,
    *,
    policy: MixedPrecisionPolicy,
    pipelined: bool = False,
) -> None:
    """Shard `model` (or one pipeline stage of it). A pipelined stage keeps its blocks gathered
    between forward and backward: resharding would all-gather again for every micro-batch."""
    blocks = list(getattr(model, plan.blocks).values())
    for index, block in enumerate(blocks):
        # Activation checkpointing wraps the block; the plan names modules of the block itself.
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        units = [inner.get_submodule(path) for path in plan.block_fsdp_units(inner)]
        # The backward starts with the last block right after its forward (only the head and
        # the loss run between): resharding it would only all-gather the same parameters again.
        reshard = not pipelined and index < len(blocks) - 1
        for unit in (*units, block):
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    # The root unit holds what is outside the blocks (for Llama embeddings, final norm and output
    # head); it is gathered for the whole step anyway, so it is not resharded after forward.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def gradient_average_compensation(mesh: DeviceMesh | None) -> int:
    """FSDP averages gradients over its ranks; the loss is already divided by the global token
    count, so gradients must be summed (DESIGN §4). Scaling the loss by the rank count undoes the
    average on every backend (gloo has no PREMUL_SUM for `set_gradient_divide_factor`)."""
    if mesh is None or mutation_on("KILN_TEST_AVERAGE_GRADIENTS"):
        return 1
    return mesh.size()
