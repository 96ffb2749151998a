"""Activation checkpointing per block of the model's plan: recompute the block's forward in backward."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from kiln.model.parallel_plan import ParallelPlan


def apply_activation_checkpointing(model: nn.Module, plan: ParallelPlan, mode: str) -> None:
    """`full` wraps every block; `selective` every other block (half the recompute, half the savings)."""
    if mode == "none":
        return
    blocks = getattr(model, plan.blocks)
    # By layer index, not position: a pipeline stage checkpoints the same blocks as the whole model.
    for name in list(blocks.keys()):
        if mode == "full" or int(name) % 2 == 0:
            blocks[name] = checkpoint_wrapper(blocks[name], preserve_rng_state=False)
