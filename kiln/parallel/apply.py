"""The one place that knows the order in which parallelisms and wrappers are applied (DESIGN §4).

PP split → TP → EP → CP → FP8 → AC → compile (per block) → FSDP2. This version applies AC,
compile and FSDP/HSDP; the remaining steps slot in at their place in this order.
"""

from __future__ import annotations

from torch import nn

from kiln.config.sections import JobConfig
from kiln.parallel.activation_checkpoint import apply_activation_checkpointing
from kiln.parallel.fsdp import apply_fsdp
from kiln.parallel.mesh import ParallelContext


def apply_parallelism(
    model: nn.Module, cfg: JobConfig, parallel: ParallelContext | None = None
) -> nn.Module:
    """Wrap `model` (still on the meta device) in place and return it."""
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()
    fsdp_mesh = parallel.fsdp_mesh() if parallel is not None else None
    if fsdp_mesh is not None:
        bf16 = cfg.train.mixed_precision == "bf16" and parallel.device.type == "cuda"
        apply_fsdp(model, fsdp_mesh, bf16=bf16)
    return model
