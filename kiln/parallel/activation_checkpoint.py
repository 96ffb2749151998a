"""Activation checkpointing per transformer block: recompute the block's forward in backward."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """`full` wraps every block; `selective` every other block (half the recompute, half the savings)."""
    if mode == "none":
        return
    # By layer index, not position: a pipeline stage checkpoints the same blocks as the whole model.
    for name in list(model.layers.keys()):
        if mode == "full" or int(name) % 2 == 0:
            model.layers[name] = checkpoint_wrapper(model.layers[name], preserve_rng_state=False)
