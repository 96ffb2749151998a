"""The one place that knows the order in which parallelisms and wrappers are applied (DESIGN §4).

PP split → TP → EP → CP → FP8 → AC → compile (per block) → FSDP2. This version applies the
single-process part (AC, compile); the distributed steps slot in at their place in this order.
"""

from __future__ import annotations

from torch import nn

from kiln.config.sections import JobConfig
from kiln.parallel.activation_checkpoint import apply_activation_checkpointing


def apply_parallelism(model: nn.Module, cfg: JobConfig) -> nn.Module:
    """Wrap `model` (still on the meta device) in place and return it."""
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()
    return model
