"""Expert-parallel dispatch: token copies travel to the rank holding their expert and back.

The same two calls as the MoE block's local dispatcher (`dispatch`, `combine`), over the `ep`
process group. Rank r holds experts [r·E/ep, (r+1)·E/ep). One MoE layer's dispatch:

1. sort this rank's (token, slot) assignments by global expert, with the local dispatcher (which
   also applies the capacity factor, to this rank's own tokens);
2. exchange the per-expert counts (one small all-to-all), which fixes every split size;
3. all-to-all the rows: each rank receives, from every source rank in rank order, that source's
   rows for each of its experts in expert order: a (source rank, expert) order;
4. reorder them to (expert, source rank), the layout the grouped experts want.

`combine` undoes 4 and 3 and hands the rows to the local combine. Every step is a permutation
(a gather in which each index occurs once) or an all-to-all, whose backward is the reverse
all-to-all: dispatch followed by combine returns the input exactly, gradients included, and an
expert's gradient sums the contributions of every source rank's tokens (sum semantics over ep).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from kiln.model.moe.dispatch import DispatchState, LocalDispatcher
from kiln.model.moe.router import is_training_forward
from kiln.parallel.all_to_all_stats import AllToAllStats


class ExpertParallelState(NamedTuple):
    local: DispatchState
    order: torch.Tensor  # received rows in (expert, source) order: their (source, expert) index
    sent: list[int]  # rows sent to each ep rank
    received: list[int]  # rows received from each ep rank


class _AllToAll(torch.autograd.Function):
    """Rows split by destination rank -> rows split by source rank; the backward sends the
    gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, rows, received, sent, group, stats):
        ctx.received, ctx.sent, ctx.group, ctx.stats = received, sent, group, stats
        return _exchange(rows, received, sent, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.sent, ctx.received, ctx.group, ctx.stats), None, None, None, None


def _exchange(rows: torch.Tensor, received: list[int], sent: list[int], group, stats):
    out = rows.new_empty(sum(received), *rows.shape[1:])
    with stats.timed(), record_function("all-to-all"):
        dist.all_to_all_single(out, rows.contiguous(), received, sent, group=group)
    row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
    rank = dist.get_rank(group)
    stats.count_bytes(sent=sent, received=received, rank=rank, row_bytes=row_bytes)
    return out


class AllToAllDispatcher:
    """`LocalDispatcher`'s interface across the ranks of `group` (the ep group), which hold the
    experts in equal contiguous slices."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        capacity_factor: float,
        *,
        group: dist.ProcessGroup,
        stats: AllToAllStats,
    ):
        self.ranks = dist.get_world_size(group)
        assert num_experts % self.ranks == 0, (num_experts, self.ranks)
        self.local = LocalDispatcher(num_experts, top_k, capacity_factor)
        self.local_experts = num_experts // self.ranks
        self.group, self.stats = group, stats
        self.rank = dist.get_rank(group)
        # Under torch.compile the exchanges run eagerly between the compiled parts of the block:
        # the split sizes are read on the host and the collectives take lists of them. Wrapped
        # here, not at import: torch.compiler.disable imports torch._dynamo (~0.8 s a process).
        self.dispatch = torch.compiler.disable(self.dispatch)
        self.combine = torch.compiler.disable(self.combine)

    def dispatch(
        self, x: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, ExpertParallelState]:
        """x (tokens, dim), indices (tokens, top_k) -> rows for this rank's experts sorted by
        expert (then source rank), rows per local expert (local experts,), and the state."""
        rows, counts, local = self.local.dispatch(x, indices)
        counts_by_source = torch.empty_like(counts)
        with self.stats.timed():
            dist.all_to_all_single(counts_by_source, counts, group=self.group)
        counts_by_source = counts_by_source.view(self.ranks, self.local_experts)
        sent = counts.view(self.ranks, self.local_experts).sum(dim=1).tolist()
        received = counts_by_source.sum(dim=1).tolist()
        if is_training_forward():  # not the recompute of a checkpointed block
            self.stats.count_tokens(sent=sent, received=received, rank=self.rank)
        arrived = _AllToAll.apply(rows, received, sent, self.group, self.stats)
        order = expert_major_order(counts_by_source)
        state = ExpertParallelState(local, order, sent, received)
        return arrived[order], counts_by_source.sum(dim=0), state

    def combine(
        self, expert_out: torch.Tensor, weights: torch.Tensor, state: ExpertParallelState
    ) -> torch.Tensor:
        """Expert outputs (rows, dim) in dispatch order -> (tokens, dim), see LocalDispatcher."""
        by_source = expert_out[torch.argsort(state.order)]
        returned = _AllToAll.apply(by_source, state.sent, state.received, self.group, self.stats)
        return self.local.combine(returned, weights, state.local)


def expert_major_order(counts: torch.Tensor) -> torch.Tensor:
    """counts (sources, experts) of rows laid out source-major -> the permutation that lists
    them expert-major: for each expert, each source's rows in source order."""
    flat = counts.flatten()
    starts = (torch.cumsum(flat, dim=0) - flat).view_as(counts)
    expert_major = counts.t().flatten()
    run_starts = starts.t().flatten()
    total = int(flat.sum())
    first_of_run = torch.cumsum(expert_major, dim=0) - expert_major
    within = torch.arange(total, device=counts.device) - torch.repeat_interleave(
        first_of_run, expert_major, output_size=total
    )
    return torch.repeat_interleave(run_starts, expert_major, output_size=total) + within
