"""The one place that knows the order in which parallelisms and wrappers are applied (DESIGN §4).

PP split → TP → EP → CP → FP8 → AC → compile (per block) → FSDP2, the later steps on each
pipeline stage. This version applies PP, TP, AC, compile and FSDP/HSDP; EP, CP and FP8 slot in at
their place in this order.
"""

from __future__ import annotations

import os

from kiln.config.sections import JobConfig
from kiln.model.transformer import Transformer
from kiln.parallel.activation_checkpoint import apply_activation_checkpointing
from kiln.parallel.fsdp import apply_fsdp
from kiln.parallel.mesh import ParallelContext
from kiln.parallel.pipeline import split_into_stages
from kiln.parallel.tensor_parallel import apply_tensor_parallel

# Test-only: FSDP before TP, the order mistake the seeds warn about. The parity tests must catch it.
WRONG_ORDER_FOR_TESTS = "KILN_TEST_FSDP_BEFORE_TP"


def apply_parallelism(
    model: Transformer, cfg: JobConfig, parallel: ParallelContext | None = None
) -> list[Transformer]:
    """Wrap `model` (still on the meta device) and return the parts this rank runs: the model
    itself, or under pipeline parallel the stages assigned to this rank, in stage order."""
    degrees = parallel.degrees if parallel is not None else {"pp": 1, "tp": 1}
    pipelined = degrees["pp"] > 1
    parts = (
        split_into_stages(model, cfg, parallel.mesh.get_local_rank("pp")) if pipelined else [model]
    )
    fsdp_mesh = parallel.fsdp_mesh() if parallel is not None else None
    bf16 = (
        parallel is not None
        and cfg.train.mixed_precision == "bf16"
        and parallel.device.type == "cuda"
    )
    wrong_order = os.environ.get(WRONG_ORDER_FOR_TESTS) == "1"
    for part in parts:
        if wrong_order and fsdp_mesh is not None:
            apply_fsdp(part, fsdp_mesh, bf16=bf16, pipelined=pipelined)
        if degrees["tp"] > 1:
            apply_tensor_parallel(part, parallel.mesh["tp"])
        apply_activation_checkpointing(part, cfg.train.activation_checkpointing)
        if cfg.train.compile:
            for block in part.layers.values():
                block.compile()
        if fsdp_mesh is not None and not wrong_order:
            apply_fsdp(part, fsdp_mesh, bf16=bf16, pipelined=pipelined)
    return parts
