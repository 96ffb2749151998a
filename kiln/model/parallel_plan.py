"""What a model family tells `kiln/parallel/` about its structure (docs/architecture.md).

The parallel recipes know the order of application and the mechanics (DTensor, fully_shard,
checkpoint wrappers, pipeline stages); the model family knows its module names. A family hands
them over as a `ParallelPlan`: its blocks (the unit of pipeline splits, activation checkpointing,
compile and FSDP), the tensor-parallel style of each module, the FSDP units inside a block, and
which top-level modules belong to the first and the last pipeline stage. Plans that differ per
block (a Mixture-of-Experts layer among dense ones) are functions of the block.

A family's plan lives in its folder (kiln/model/llama/plan.py); see there for how the Llama
family's Mixture-of-Experts blocks meet tensor parallel (`block_sequence_units`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle


@dataclass(frozen=True)
class ParallelPlan:
    # Attribute holding the blocks: an nn.ModuleDict keyed by layer index, so that a pipeline
    # stage that drops blocks keeps the others' names.
    blocks: str
    # Tensor-parallel style of each top-level module, applied to those a stage holds.
    tp: dict[str, ParallelStyle]
    # Tensor-parallel styles inside one block, by module path within it.
    block_tp: Callable[[nn.Module], dict[str, ParallelStyle]]
    # Sub-modules of one block sharded as FSDP units of their own, inside the block's unit.
    block_fsdp_units: Callable[[nn.Module], tuple[str, ...]]
    # Top-level modules only the first / only the last pipeline stage holds (one may be in both).
    first_stage: tuple[str, ...]
    last_stage: tuple[str, ...]
    # A parameter held by both the first and the last stage (tied embeddings), or None.
    tied_weight: str | None = None
    # Units among `block_fsdp_units` that tensor parallel leaves whole: each tp rank runs them on
    # its own part of the sequence, so FSDP shards them over the data and tp ranks together and
    # their gradients are summed over both (see the module doc).
    block_sequence_units: Callable[[nn.Module], tuple[str, ...]] = lambda block: ()
    # Mixture-of-Experts layers of one block, by path: modules with a `dispatcher` (the
    # `LocalDispatcher` interface) and stacked `experts`, which expert parallel splits over ep.
    block_moe: Callable[[nn.Module], tuple[str, ...]] = lambda block: ()
    # Attention layers of one block, by path: modules whose forward takes `context_parallel` and
    # gathers the keys and values of the sequence's other parts with it. None named: the family
    # cannot run context parallel.
    block_attention: Callable[[nn.Module], tuple[str, ...]] = lambda block: ()
    # Linear layers FP8 keeps in high precision, by name or name segment (kiln/parallel/float8.py).
    float8_excluded: tuple[str, ...] = ()
    # Blocks outside `blocks` that a model part holds (DeepSeek-V3's multi-token prediction
    # depths), {path: the layer index it counts as}: tensor, expert and context parallel,
    # activation checkpointing, compile and FSDP treat them like the main blocks, after them.
    # The per-block functions above are called with them too.
    extra_blocks: Callable[[nn.Module], dict[str, int]] = lambda model: {}


class Block(NamedTuple):
    """One block a model part holds: its path from the part, its layer index, the module."""

    path: str
    layer: int
    module: nn.Module


def blocks_of(model: nn.Module, plan: ParallelPlan) -> list[Block]:
    """Every block of `model` (a model or one pipeline stage) the plan names, in the order the
    forward runs them: the main blocks, then the extra ones."""
    main = [
        Block(f"{plan.blocks}.{name}", int(name), block)
        for name, block in getattr(model, plan.blocks).items()
    ]
    extra = [
        Block(path, layer, model.get_submodule(path))
        for path, layer in plan.extra_blocks(model).items()
    ]
    return main + extra
