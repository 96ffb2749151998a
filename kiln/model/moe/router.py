"""Token-choice router: which top-k experts each token goes to, and with what weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class RouterOutput(NamedTuple):
    indices: torch.Tensor  # (tokens, top_k) chosen experts
    weights: torch.Tensor  # (tokens, top_k) fp32 weights of their outputs
    scores: torch.Tensor  # (tokens, experts) fp32 softmax or sigmoid scores
    logits: torch.Tensor  # (tokens, experts) fp32 gate logits
    counts: torch.Tensor  # (experts,) int64 assignments per expert, before any capacity drop


class Router(nn.Module):
    """Scores every expert, picks the top k of (score + expert_bias) inside the best groups.

    `expert_bias` (DeepSeek-V3 auxiliary-loss-free balancing) is a buffer moved by
    `update_expert_biases`, never by the optimizer; it changes which experts are chosen and
    never how much they weigh. `tokens_per_expert` counts the assignments of the training
    forwards since the last bias update.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax_topk",
        route_norm: bool = True,
        route_scale: float = 1.0,
        n_groups: int = 1,
        topk_groups: int = 1,
        bias: bool = False,
    ):
        super().__init__()
        if score_func not in ("softmax_topk", "sigmoid"):
            raise ValueError(f"unknown router score function {score_func!r}")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        self.n_groups, self.topk_groups = n_groups, topk_groups
        self.gate = nn.Linear(dim, num_experts, bias=bias)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False
        )

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """x (tokens, dim) -> the routing of every token."""
        # Routing decisions are sensitive to rounding: the gate runs in fp32 even under autocast.
        with torch.autocast(x.device.type, enabled=False):
            bias = self.gate.bias.float() if self.gate.bias is not None else None
            logits = F.linear(x.float(), self.gate.weight.float(), bias)
        scores = logits.softmax(dim=-1) if self.score_func == "softmax_topk" else logits.sigmoid()
        choice = self._limit_groups(scores.detach() + self.expert_bias)
        indices = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, indices)
        if self.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        counts = count_values(indices, self.num_experts)
        if is_training_forward():
            self.tokens_per_expert += counts
        return RouterOutput(indices, weights, scores, logits, counts)

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Mask (to -inf) the experts outside each token's best `topk_groups` groups. A group's
        score is its best expert's for softmax scores and the sum of its best two for sigmoid
        scores (DeepSeek-V3), both taken with the bias, like the selection itself."""
        if self.n_groups <= 1:
            return choice
        grouped = choice.view(choice.shape[0], self.n_groups, -1)
        if self.score_func == "sigmoid":
            best = min(2, grouped.shape[-1])
            group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = group_scores.topk(self.topk_groups, dim=-1).indices
        mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        return grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).view_as(choice)

    def init_buffers(self) -> None:
        """Zero the balancing state (buffers hold garbage after `to_empty`)."""
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()


def count_values(values: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0 .. n-1 occurs in `values`, as int64 (n,): `torch.bincount` with its
    size fixed, which torch.compile traces (bincount's size depends on the data, a graph break).
    Integer sums: exact in any order."""
    flat = values.flatten()
    counts = torch.zeros(n, dtype=torch.int64, device=values.device)
    return counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


# False inside `uncounted()`.
_COUNTING = True


def is_training_forward() -> bool:
    """Whether this forward's routing belongs to the optimizer step: gradients are on (not eval),
    it is not the recompute of a checkpointed block, which runs inside backward (where the
    autograd engine has a current graph task) and would count its tokens a second time, and it
    is not inside `uncounted()`."""
    return _COUNTING and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Forwards inside are not part of the optimizer step although gradients are on (a pipeline
    schedule's shape inference): their routing counts toward no expert load."""
    global _COUNTING
    saved, _COUNTING = _COUNTING, False
    try:
        yield
    finally:
        _COUNTING = saved
