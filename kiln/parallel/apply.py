"""The one place that knows the order in which parallelisms and wrappers are applied
(docs/architecture.md, "The apply order").

PP split → TP → EP → CP → FP8 → AC → compile (per block) → FSDP2, the later steps on each
pipeline stage, with one exception: FP8's conversion swaps linear modules for torchao's
Float8Linear, which must happen before TP wraps them, so it runs right after the split
(float8.py). What each step applies to (blocks, module styles, FSDP units, stage boundaries)
comes from the model family's plan (kiln/model/family.py).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from kiln.config.sections import JobConfig
from kiln.model import build_model, materialize
from kiln.model.parallel_plan import blocks_of
from kiln.model.registry import family_of
from kiln.parallel.activation_checkpoint import apply_activation_checkpointing
from kiln.parallel.all_to_all_stats import AllToAllStats
from kiln.parallel.compile import compile_blocks
from kiln.parallel.context_parallel import check_context_parallel
from kiln.parallel.expert_parallel import apply_expert_parallel
from kiln.parallel.float8 import convert_to_float8
from kiln.parallel.fsdp import apply_fsdp
from kiln.parallel.mesh import ParallelContext
from kiln.parallel.mixed_precision import fsdp_policy
from kiln.parallel.pipeline import split_into_stages
from kiln.parallel.tensor_parallel import apply_tensor_parallel


def apply_parallelism(
    model: nn.Module, cfg: JobConfig, parallel: ParallelContext | None = None
) -> list[nn.Module]:
    """Wrap `model` (still on the meta device) and return the parts this rank runs: the model
    itself, or under pipeline parallel the stages assigned to this rank, in stage order."""
    plan = family_of(cfg.model).parallel_plan(cfg.model)
    # Decided on the whole model: every rank takes part in creating the sequence mesh.
    sequence_units = any(plan.block_sequence_units(b.module) for b in blocks_of(model, plan))
    degrees = parallel.degrees if parallel is not None else {"pp": 1, "tp": 1, "ep": 1, "cp": 1}
    pipelined = degrees["pp"] > 1
    parts = split_into_stages(cfg, parallel.mesh.get_local_rank("pp")) if pipelined else [model]
    fsdp_mesh = parallel.fsdp_mesh() if parallel is not None else None
    # Units tensor parallel leaves whole (MoE) are sharded over the data and tp ranks.
    sequence_mesh = _sequence_mesh(parallel) if sequence_units else None
    expert_mesh = parallel.expert_fsdp_mesh() if degrees["ep"] > 1 else None
    # One per rank, shared by the dispatchers of all its stages: what the exchanges moved.
    all_to_all_stats = AllToAllStats(parallel.device) if degrees["ep"] > 1 else None
    sharded = fsdp_mesh is not None or sequence_mesh is not None
    shard = partial(
        apply_fsdp,
        plan=plan,
        mesh=fsdp_mesh,
        policy=fsdp_policy(cfg),
        sequence_mesh=sequence_mesh,
        expert_mesh=expert_mesh,
        pipelined=pipelined,
        reshard_after_forward=cfg.distributed.reshard_after_forward,
    )
    for part in parts:
        if cfg.train.mixed_precision == "fp8":
            convert_to_float8(
                part,
                cfg,
                device=_device(parallel),
                tp=degrees["tp"],
                excluded=plan.float8_excluded,
            )
        if degrees["tp"] > 1:
            apply_tensor_parallel(part, plan, parallel.mesh["tp"], float8=_float8_styles(cfg))
        if degrees["ep"] > 1:
            apply_expert_parallel(part, plan, parallel.ep_mesh(), all_to_all_stats)
        if degrees["cp"] > 1:
            check_context_parallel(part, plan)
        apply_activation_checkpointing(part, plan, cfg.train.activation_checkpointing)
        if cfg.train.compile:
            compile_blocks(part, plan, communicating=degrees["tp"] > 1 or degrees["cp"] > 1)
        if sharded:
            shard(part)
    return parts


def _float8_styles(cfg: JobConfig) -> bool:
    # torchao's float8 tensor-parallel styles assume one scale per tensor.
    return cfg.train.mixed_precision == "fp8" and cfg.fp8.recipe == "tensorwise"


def _device(parallel: ParallelContext | None) -> torch.device:
    return parallel.device if parallel is not None else torch.device("cpu")


def _sequence_mesh(parallel: ParallelContext | None) -> DeviceMesh | None:
    if parallel is None:
        return None
    return parallel.sequence_fsdp_mesh()


def build_parallel_model(
    cfg: JobConfig, parallel: ParallelContext, *, seed: int | None
) -> list[nn.Module]:
    """The model of `cfg` built on the meta device, parallelized, then materialized on this
    rank's device: initialized from `seed`, or left for a checkpoint to fill (seed None)."""
    parts = apply_parallelism(build_model(cfg.model), cfg, parallel)
    for part in parts:
        materialize(part, device=parallel.device, seed=seed)
    return parts
