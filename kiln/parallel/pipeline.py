"""Pipeline parallel on `torch.distributed.pipelining`: stage modules, the schedule, tied weights.

Each stage is the model's family building one part of it (kiln/model/forward_args.py, StageRole):
its blocks under their whole-model names, so checkpoints move between pipelined and unpipelined
layouts. Stages after the first take hidden states instead of tokens; stages before the last
return hidden states.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.config.sections import JobConfig
from kiln.model.forward_args import StageRole
from kiln.model.registry import family_of
from kiln.parallel.mesh import ParallelContext
from kiln.parallel.pipeline_split import (
    microbatches,
    num_stages,
    stage_layers,
    stage_rank,
    stages_of_rank,
)

# Schedule class names in torch.distributed.pipelining. That package imports torch._dynamo (half
# a second per process): it is imported when a pipeline is built, not by every run.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}


def split_into_stages(cfg: JobConfig, pp_rank: int) -> list[nn.Module]:
    """The stages `pp_rank` runs, each built by the model's family on the meta device with its
    blocks and its role (first stage, last stage)."""
    family, dist_cfg, last = family_of(cfg.model), cfg.distributed, num_stages(cfg.distributed) - 1
    parts = []
    for stage in stages_of_rank(dist_cfg, pp_rank):
        layers = tuple(stage_layers(dist_cfg, cfg.model.n_layers, stage))
        role = StageRole(layers, first=stage == 0, last=stage == last)
        with torch.device("meta"):
            parts.append(family.build(cfg.model, role))
    return parts


def build_schedule(
    parts: list[nn.Module],
    cfg: JobConfig,
    parallel: ParallelContext,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    rows: int,
):
    """The configured schedule over this rank's stages (new `Stage` objects around the same
    modules) for passes of `rows` sequences. `loss_fn` returns the already normalized loss of one
    micro-batch, so the schedule must not rescale gradients (scale_grads=False)."""
    from torch.distributed import pipelining

    from kiln.parallel.pipeline_stage import Stage

    dist_cfg = cfg.distributed
    group = parallel.mesh["pp"].get_group()
    stages = [
        Stage(part, stage, num_stages(dist_cfg), parallel.device, group=group)
        for part, stage in zip(
            parts, stages_of_rank(dist_cfg, parallel.mesh.get_local_rank("pp")), strict=True
        )
    ]
    schedule_class = getattr(pipelining, SCHEDULES[dist_cfg.pp_schedule])
    return schedule_class(
        stages[0] if len(stages) == 1 and dist_cfg.pp_schedule in ("gpipe", "1f1b") else stages,
        n_microbatches=microbatches(dist_cfg, rows),
        loss_fn=loss_fn,
        # False: the loss is already normalized; scaling again would divide twice, which the
        # parity tests catch (tests/support/mutations.py).
        scale_grads=False,
    )


def tied_weights(
    parts: list[nn.Module], cfg: JobConfig, parallel: ParallelContext
) -> TiedEmbedding | None:
    """The sync of a weight two pipeline stages hold (the family's plan names it: tied
    embeddings, DeepSeek-V3's embedding under multi-token prediction); None without one."""
    pipelined = parallel.degrees["pp"] > 1
    if not pipelined or family_of(cfg.model).parallel_plan(cfg.model).tied_weight is None:
        return None
    return TiedEmbedding(parts, cfg, parallel)


class TiedEmbedding:
    """Keeps the first stage's embedding and the last stage's output head, one weight held twice,
    in step: their gradients are summed so both copies take the same optimizer step. Every rank
    constructs it (it creates process groups); ranks holding neither copy have nothing to do."""

    def __init__(self, parts: list[nn.Module], cfg: JobConfig, parallel: ParallelContext):
        name = family_of(cfg.model).parallel_plan(cfg.model).tied_weight
        held = [(part, _held(part, name)) for part in parts] if name is not None else []
        self.copies = [weight for _, weight in held if weight is not None]
        # The last stage's copy: clipped like the other, counted once in the gradient norm.
        self.duplicates = [w for part, w in held if w is not None and not part.stage.first]
        self.group = _first_last_stage_group(cfg, parallel)

    @torch.no_grad()
    def sync_grads(self) -> None:
        for w in self.copies:
            # The embedding's backward under tensor parallel leaves a replicated gradient for a
            # row-sharded weight; bring it to the weight's layout so the two copies line up.
            if isinstance(w.grad, DTensor) and w.grad.placements != w.placements:
                w.grad = w.grad.redistribute(w.device_mesh, w.placements)
        grads = [_local(w.grad) for w in self.copies]
        if len(grads) == 2:  # both stages on this rank (zbv)
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif grads and self.group is not None:
            dist.all_reduce(grads[0], group=self.group)


def _first_last_stage_group(cfg: JobConfig, parallel: ParallelContext) -> dist.ProcessGroup | None:
    """For every (data, tensor) position, a group of the ranks holding the first and the last
    stage; None where one rank holds both or neither. Every rank takes part in creating every
    group, as new_group requires."""
    last = stage_rank(cfg.distributed, num_stages(cfg.distributed) - 1)
    if last == 0:
        return None
    ranks = parallel.mesh.mesh  # (pp, dp_replicate, dp_shard, ep, cp, tp)
    pairs = torch.stack([ranks[0].flatten(), ranks[last].flatten()], dim=1).tolist()
    mine, _ = dist.new_subgroups_by_enumeration(pairs)
    return mine


def _held(part: nn.Module, path: str) -> torch.Tensor | None:
    """The parameter at `path` in this stage, or None where the stage dropped its module."""
    *modules, name = path.split(".")
    for module in modules:
        part = getattr(part, module)
        if part is None:
            return None
    return getattr(part, name)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
