"""The one place that knows the order in which parallelisms and wrappers are applied (DESIGN §4).

PP split → TP → EP → CP → FP8 → AC → compile (per block) → FSDP2. This version applies TP, AC,
compile and FSDP/HSDP; PP, EP, CP and FP8 slot in at their place in this order.
"""

from __future__ import annotations

import os

from torch import nn

from kiln.config.sections import JobConfig
from kiln.parallel.activation_checkpoint import apply_activation_checkpointing
from kiln.parallel.fsdp import apply_fsdp
from kiln.parallel.mesh import ParallelContext
from kiln.parallel.tensor_parallel import apply_tensor_parallel

# Test-only: FSDP before TP, the order mistake the seeds warn about. The parity tests must catch it.
WRONG_ORDER_FOR_TESTS = "KILN_TEST_FSDP_BEFORE_TP"


def apply_parallelism(
    model: nn.Module, cfg: JobConfig, parallel: ParallelContext | None = None
) -> nn.Module:
    """Wrap `model` (still on the meta device) in place and return it."""
    tp = parallel is not None and parallel.degrees["tp"] > 1
    fsdp_mesh = parallel.fsdp_mesh() if parallel is not None else None
    bf16 = (
        parallel is not None
        and cfg.train.mixed_precision == "bf16"
        and parallel.device.type == "cuda"
    )
    wrong_order = os.environ.get(WRONG_ORDER_FOR_TESTS) == "1"
    if wrong_order and fsdp_mesh is not None:
        apply_fsdp(model, fsdp_mesh, bf16=bf16)
    if tp:
        apply_tensor_parallel(model, parallel.mesh["tp"])
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()
    if fsdp_mesh is not None and not wrong_order:
        apply_fsdp(model, fsdp_mesh, bf16=bf16)
    return model
