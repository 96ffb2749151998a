"""FSDP2 (`fully_shard`) per sub-module: the units the model's plan names inside each block (for
Llama attention and MLP; in an MoE block attention, the routed experts and the rest of the MoE
feed-forward), then the block, then the root.

Separate units for attention and MLP mean only one of them is unsharded at a time, which the
reference framework whose recipes kiln ships measured as 11% less peak memory and far less
allocator pressure than whole-block units.
A 2-D mesh (dp_replicate, dp_shard) gives HSDP: shard within a replica, all-reduce across.

Units that tensor parallel leaves whole (the plan's `block_sequence_units`, the MoE feed-forward)
see other tokens on every tp rank, so they are sharded over the data and tp ranks together (the
"sequence mesh") and their gradients summed over both; see `_sum_gradients` for the scale.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from kiln.model.parallel_plan import ParallelPlan, blocks_of


def apply_fsdp(
    model: nn.Module,
    plan: ParallelPlan,
    mesh: DeviceMesh | None,
    *,
    policy: MixedPrecisionPolicy,
    sequence_mesh: DeviceMesh | None = None,
    expert_mesh: DeviceMesh | None = None,
    pipelined: bool = False,
    reshard_after_forward: bool = True,
) -> None:
    """Shard `model` (or one pipeline stage of it) over `mesh`, and the plan's sequence units
    over `sequence_mesh` (None: tp = 1, they go on `mesh` like the rest) and, under expert
    parallel, the experts over `expert_mesh` (each ep rank's slice). `mesh` None (tp alone,
    no data parallel): only the sequence units are sharded, over tp, so that their gradients
    are summed. A pipelined stage keeps its blocks gathered between forward and backward:
    resharding would all-gather again for every micro-batch. `reshard_after_forward` False
    keeps every block gathered from its forward to its backward (less traffic, more memory)."""
    blocks = [block.module for block in blocks_of(model, plan)]
    for index, block in enumerate(blocks):
        # Activation checkpointing wraps the block; the plan names modules of the block itself.
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        sequence_units = set(plan.block_sequence_units(inner)) if sequence_mesh else set()
        experts = _expert_modules(inner, plan)
        # The backward starts with the last block right after its forward (only the head and
        # the loss run between): resharding it would only all-gather the same parameters again.
        reshard = reshard_after_forward and not pipelined and index < len(blocks) - 1
        for path in plan.block_fsdp_units(inner):
            unit = inner.get_submodule(path)
            is_experts = any(unit is e for e in experts)
            if is_experts and expert_mesh is not None:
                _shard_sequence_unit(unit, expert_mesh, mesh, policy, reshard, experts=True)
            elif path in sequence_units:
                _shard_sequence_unit(unit, sequence_mesh, mesh, policy, reshard, experts=is_experts)
            elif mesh is not None:
                placement = _within_experts(_shard_ranks(mesh)) if is_experts else None
                fully_shard(
                    unit,
                    mesh=mesh,
                    mp_policy=policy,
                    reshard_after_forward=reshard,
                    shard_placement_fn=placement,
                )
        if mesh is not None:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    # The root unit holds what is outside the blocks (for Llama embeddings, final norm and output
    # head); it is gathered for the whole step anyway, so it is not resharded after forward.
    # The chunked loss relies on it: it applies the gathered head after the model's forward.
    if mesh is not None:
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def _shard_ranks(mesh: DeviceMesh) -> int:
    """The ranks a parameter is sharded over: the mesh's last dimension (HSDP replicates over the
    first). Indexed from the front: torch 2.11's `DeviceMesh.size` takes no negative dimension."""
    return mesh.size(mesh.ndim - 1)


def _expert_modules(block: nn.Module, plan: ParallelPlan) -> list[nn.Module]:
    # Under expert parallel their all-to-all backward already summed the gradients over ep;
    # FSDP sums over the rest.
    return [block.get_submodule(path).experts for path in plan.block_moe(block)]


def _within_experts(ranks: int) -> Callable[[nn.Parameter], Shard | None]:
    """Where FSDP splits a stacked expert weight (experts, rows, cols) over `ranks`: by default it
    would split dim 0, the experts, in whole experts, so with fewer experts (per ep rank) than
    ranks some ranks hold one whole expert of padding and the rest nothing, and memory does not
    shrink with the ranks. Splitting every expert's rows (or else its columns) gives each rank
    1/ranks of each; FSDP splits a dim other than 0 only evenly, so a weight whose rows and
    columns both do not divide keeps the default."""

    def placement(param: nn.Parameter) -> Shard | None:
        for dim in (1, 2):
            if param.shape[dim] % ranks == 0:
                return Shard(dim)
        return None

    return placement


def _shard_sequence_unit(
    unit: nn.Module,
    sequence_mesh: DeviceMesh,
    mesh: DeviceMesh | None,
    policy: MixedPrecisionPolicy,
    reshard: bool,
    *,
    experts: bool,
) -> None:
    # Without data parallel the forward runs under autocast (mixed_precision.py): a casting
    # policy here would cast twice.
    unit_policy = policy if mesh is not None else MixedPrecisionPolicy()
    fully_shard(
        unit,
        mesh=sequence_mesh,
        mp_policy=unit_policy,
        reshard_after_forward=reshard,
        shard_placement_fn=_within_experts(_shard_ranks(sequence_mesh)) if experts else None,
    )
    _sum_gradients(
        unit, gradient_average_compensation(mesh), shard_ranks=_shard_ranks(sequence_mesh)
    )


def _sum_gradients(unit: FSDPModule, loss_scale: int, *, shard_ranks: int) -> None:
    """Gradients summed over the unit's whole mesh. The loss carries `loss_scale` (the data
    FSDP mesh's size, see `gradient_average_compensation`), which FSDP's default average over
    that mesh undoes; this unit's mesh is tp times larger, so its gradients are divided by
    `loss_scale` instead. torch 2.13 divides by a custom factor with PREMUL_SUM, which gloo
    lacks, unless forced to sum: then it reduce-scatters (and, for HSDP, all-reduces) with SUM
    and divides the result by the factor (none for 1), exactly, on every backend. Not when the
    unit is sharded over one rank (expert parallel without dp_shard or tp): there torch 2.13
    divides a forced sum by the factor twice (once in its copy in place of the reduce-scatter,
    once after it), and without it only once, with no PREMUL_SUM collective to run."""
    unit.set_gradient_divide_factor(float(loss_scale))
    unit.set_force_sum_reduction_for_comms(shard_ranks > 1)


def gradient_average_compensation(mesh: DeviceMesh | None) -> int:
    """FSDP averages gradients over its ranks; the loss is already divided by the global token
    count, so gradients must be summed (docs/architecture.md, "Loss normalization"). Scaling the
    loss by the rank count undoes the average on every backend (gloo has no PREMUL_SUM for
    `set_gradient_divide_factor`)."""
    if mesh is None:
        return 1
    return mesh.size()
