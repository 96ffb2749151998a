"""Expert parallel (docs/moe.md): each MoE layer's routed experts split over the `ep` ranks, tokens
carried to them and back by all-to-all.

Rank r of the ep group holds experts [r·E/ep, (r+1)·E/ep): the stacked expert weights become
DTensors sharded along the expert dimension (`Shard(0)` on the ep mesh), so that state dicts and
checkpoints keep their logical (experts × …) shapes; FSDP then shards each rank's slice further
over the other ranks holding different tokens (fsdp.py). The ep ranks read different batches, so
nothing is computed twice: every token still meets its experts once, on the rank that holds them.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from kiln.model.parallel_plan import ParallelPlan, blocks_of
from kiln.parallel.all_to_all_stats import AllToAllStats
from kiln.parallel.expert_dispatch import AllToAllDispatcher


def apply_expert_parallel(
    model: nn.Module, plan: ParallelPlan, ep_mesh: DeviceMesh, stats: AllToAllStats
) -> None:
    """Give every MoE layer the plan names an all-to-all dispatcher over `ep_mesh` and split its
    experts' weights over it; `stats` collects what the exchanges move (one per rank)."""
    group = ep_mesh.get_group()
    for block in (b.module for b in blocks_of(model, plan)):
        for path in plan.block_moe(block):
            moe = block.get_submodule(path)
            local = moe.dispatcher
            moe.dispatcher = AllToAllDispatcher(
                local.num_experts, local.top_k, local.capacity_factor, group=group, stats=stats
            )
            _split_over_experts(moe.experts, ep_mesh)


def _split_over_experts(experts: nn.Module, ep_mesh: DeviceMesh) -> None:
    for name, param in list(experts.named_parameters(recurse=False)):
        # On the meta device nothing is copied: each rank keeps the shape of its slice.
        split = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))


def expert_parallel_stats(model_parts: list[nn.Module]) -> AllToAllStats | None:
    """The stats object of this rank's expert-parallel dispatchers; None without them."""
    for part in model_parts:
        for module in part.modules():
            dispatcher = getattr(module, "dispatcher", None)
            if isinstance(dispatcher, AllToAllDispatcher):
                return dispatcher.stats
    return None
