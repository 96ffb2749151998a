"""Moving token copies to their experts and back, on one rank.

`dispatch` lays the (token, slot) assignments out sorted by expert and `combine` brings the
expert outputs back and weighs them. Expert parallel implements the same two calls with
all-to-all exchanges; the MoE block only ever calls these two.

Both directions are deterministic, gradients included: the k slots of a token are summed in
slot order (the copies' gradients in dispatch, the weighted outputs in combine) from a per-slot
(tokens · top_k) layout in which every index occurs once, never by an atomic scatter-add whose
order is unspecified. The copies themselves are gathered straight from the tokens: no per-slot
copy of the input is made.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kiln.model.moe.router import count_values


class DispatchState(NamedTuple):
    order: torch.Tensor  # (kept assignments,) slot index (token · top_k + k) of each sorted row
    num_tokens: int


class LocalDispatcher:
    """Sort assignments by expert (stable: token order kept inside an expert); with a capacity
    factor, each expert keeps its first ceil(factor · tokens · top_k / experts) assignments in
    that order, i.e. lower token indices first, and the others are dropped (they add nothing)."""

    def __init__(self, num_experts: int, top_k: int, capacity_factor: float = 0.0):
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor

    def dispatch(
        self, x: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """x (tokens, dim), indices (tokens, top_k) -> rows sorted by expert (kept, dim), rows
        per expert (experts,), and the state `combine` needs."""
        num_tokens = x.shape[0]
        experts = indices.flatten()
        order = torch.argsort(experts, stable=True)
        counts = count_values(experts, self.num_experts)
        if self.capacity_factor > 0:
            order, counts = self._drop_over_capacity(order, experts, counts, num_tokens)
        rows = _TokenCopies.apply(x, order, self.top_k)
        return rows, counts, DispatchState(order, num_tokens)

    def combine(
        self, expert_out: torch.Tensor, weights: torch.Tensor, state: DispatchState
    ) -> torch.Tensor:
        """Expert outputs (kept, dim) in dispatch order, weights (..., top_k) over the tokens ->
        (..., dim) in the weights' dtype: sum over each token's slots of weight · output. The
        output takes the weights' leading shape, so a block can combine straight into its
        input's shape instead of returning a view of a flat result."""
        dim = expert_out.shape[-1]
        slots = expert_out.new_zeros(state.num_tokens * self.top_k, dim)
        slots = slots.index_copy(0, state.order, expert_out)
        slots = slots.view(*weights.shape[:-1], self.top_k, dim)
        # All slots in one product and one sum over the slot axis (in slot order, see module
        # doc); the product promotes the outputs to the weights' dtype, as the sum needs.
        return (slots * weights.unsqueeze(-1)).sum(dim=-2)

    def capacity(self, num_tokens: int) -> int:
        """Most assignments one expert keeps out of `num_tokens` tokens."""
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def _drop_over_capacity(
        self, order: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        capacity = self.capacity(num_tokens)
        first_row = torch.cumsum(counts, dim=0) - counts
        rank_in_expert = torch.arange(len(order), device=order.device) - first_row[experts[order]]
        return order[rank_in_expert < capacity], counts.clamp(max=capacity)


class _TokenCopies(torch.autograd.Function):
    """x (tokens, dim) -> the row of each sorted slot, x[order // top_k], gathered straight from
    the tokens. Its backward writes the rows' gradients to a per-slot layout (every slot once)
    and sums each token's k slots in slot order: the same values, bit for bit, as the gradient
    of a gather from a per-slot copy of x, without making that copy in forward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.top_k, ctx.num_tokens = top_k, x.shape[0]
        return x.index_select(0, torch.div(order, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (order,) = ctx.saved_tensors
        slots = grad.new_zeros(ctx.num_tokens * ctx.top_k, grad.shape[-1])
        slots.index_copy_(0, order, grad)
        return slots.view(ctx.num_tokens, ctx.top_k, -1).sum(dim=1), None, None
