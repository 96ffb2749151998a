"""Activation checkpointing per block of the model's plan: recompute the block's forward in backward."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from kiln.model.parallel_plan import ParallelPlan, blocks_of


def apply_activation_checkpointing(model: nn.Module, plan: ParallelPlan, mode: str) -> None:
    """`full` wraps every block; `selective` every other block (half the recompute, half the savings)."""
    if mode == "none":
        return
    # By layer index, not position: a pipeline stage checkpoints the same blocks as the whole model.
    for block in blocks_of(model, plan):
        if mode == "full" or block.layer % 2 == 0:
            wrapped = checkpoint_wrapper(block.module, preserve_rng_state=False)
            model.set_submodule(block.path, wrapped)
