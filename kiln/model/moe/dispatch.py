"""Moving token copies to their experts and back, on one rank.

`dispatch` lays the (token, slot) assignments out sorted by expert and `combine` brings the
expert outputs back and weighs them. Expert parallel implements the same two calls with
all-to-all exchanges; the MoE block only ever calls these two.

Both directions are deterministic, gradients included: a token's copy is gathered from a
per-slot (tokens · top_k) layout, so every index occurs once, and the k slots of a token are
summed in slot order, never by an atomic scatter-add whose order is unspecified.
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
        num_tokens, dim = x.shape
        experts = indices.flatten()
        order = torch.argsort(experts, stable=True)
        counts = count_values(experts, self.num_experts)
        if self.capacity_factor > 0:
            order, counts = self._drop_over_capacity(order, experts, counts, num_tokens)
        # One row per slot, then a gather in which every index occurs once (see module doc).
        slots = x.unsqueeze(1).expand(num_tokens, self.top_k, dim).reshape(-1, dim)
        return slots[order], counts, DispatchState(order, num_tokens)

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
        out = slots[..., 0, :] * weights[..., :1]
        for k in range(1, self.top_k):
            out = out + slots[..., k, :] * weights[..., k : k + 1]
        return out

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
