"""The one place that knows the order in which parallelisms and wrappers are applied (DESIGN §4).

PP split → TP → EP → CP → FP8 → AC → compile (per block) → FSDP2, the later steps on each
pipeline stage. This version applies PP, TP, AC, compile and FSDP/HSDP; EP, CP and FP8 slot in at
their place in this order. What each step applies to (blocks, module styles, FSDP units, stage
boundaries) comes from the model family's plan, `model.parallel_plan()`.
"""

from __future__ import annotations

from kiln.config.sections import JobConfig
from kiln.model.transformer import Transformer
from kiln.parallel.activation_checkpoint import apply_activation_checkpointing
from kiln.parallel.fsdp import apply_fsdp
from kiln.parallel.mesh import ParallelContext
from kiln.parallel.mixed_precision import fsdp_policy
from kiln.parallel.mutations import mutation_on
from kiln.parallel.pipeline import split_into_stages
from kiln.parallel.tensor_parallel import apply_tensor_parallel


def apply_parallelism(
    model: Transformer, cfg: JobConfig, parallel: ParallelContext | None = None
) -> list[Transformer]:
    """Wrap `model` (still on the meta device) and return the parts this rank runs: the model
    itself, or under pipeline parallel the stages assigned to this rank, in stage order."""
    plan = model.parallel_plan()
    degrees = parallel.degrees if parallel is not None else {"pp": 1, "tp": 1}
    pipelined = degrees["pp"] > 1
    parts = (
        split_into_stages(model, cfg, parallel.mesh.get_local_rank("pp")) if pipelined else [model]
    )
    fsdp_mesh = parallel.fsdp_mesh() if parallel is not None else None
    policy = fsdp_policy(cfg)
    # The order mistake the seeds warn about; the parity tests must catch it.
    wrong_order = mutation_on("KILN_TEST_FSDP_BEFORE_TP") and fsdp_mesh is not None
    for part in parts:
        if wrong_order:
            apply_fsdp(part, plan, fsdp_mesh, policy=policy, pipelined=pipelined)
        if degrees["tp"] > 1:
            apply_tensor_parallel(part, plan, parallel.mesh["tp"])
        apply_activation_checkpointing(part, plan, cfg.train.activation_checkpointing)
        if cfg.train.compile:
            for block in getattr(part, plan.blocks).values():
                block.compile()
        if fsdp_mesh is not None and not wrong_order:
            apply_fsdp(part, plan, fsdp_mesh, policy=policy, pipelined=pipelined)
    return parts
