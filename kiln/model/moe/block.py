"""The Mixture-of-Experts feed-forward: a router, routed experts and optional shared experts."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kiln.config.sections import ModelConfig
from kiln.model.feed_forward import FeedForward
from kiln.model.moe.balancing import (
    AuxLossScale,
    attach_aux_loss,
    load_balance_sum,
    normalized_scores,
    router_z_sum,
    sequence_balance_sum,
)
from kiln.model.moe.dispatch import LocalDispatcher
from kiln.model.moe.experts import Activation, GroupedExperts
from kiln.model.moe.router import Router, RouterOutput, is_training_forward

# The balancing losses, in the order of `MoEFeedForward.aux_loss_sums`.
AUX_LOSSES = ("load_balance", "seq_balance", "router_z")


class MoEFeedForward(nn.Module):
    """out = Σ_k weight_k · expert_k(x) + [sigmoid(shared_gate(x)) ·] shared_experts(x).

    A forward computes the balancing losses it needs and no others: those with a weight when it
    builds a gradient, and all of them when its `scale.record` asks for the step's records.
    After a recorded forward `aux_losses` holds the detached, unweighted losses of that forward
    normalized by its own tokens and sequences (the papers' values), and the buffer
    `aux_loss_sums` adds up their unnormalized sums (AUX_LOSSES order) over the recorded
    training forwards of the step (those `tokens_per_expert` counts), for the step's metrics.

    The forward's `scale` (an `AuxLossScale`, from the training step) normalizes the losses over
    the whole step and sums the expert counts over the ranks holding the step's other tokens;
    without it each forward normalizes by its own tokens (one process, no step) and records
    nothing.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        experts, hidden = cfg.moe.num_experts, cfg.expert_hidden_dim
        self.router = Router(
            cfg.dim,
            experts,
            cfg.moe.top_k,
            score_func=cfg.moe.router,
            route_norm=cfg.moe.route_norm,
            route_scale=cfg.moe.route_scale,
            n_groups=cfg.moe.n_groups,
            topk_groups=cfg.moe.topk_groups,
            bias=cfg.moe.bias,
        )
        self.dispatcher = LocalDispatcher(experts, cfg.moe.top_k, cfg.moe.capacity_factor)
        moe = cfg.moe
        activation = Activation(
            moe.activation == "clamped_swiglu", moe.swiglu_alpha, moe.swiglu_limit
        )
        self.experts = GroupedExperts(
            experts, cfg.dim, hidden, bias=moe.bias, activation=activation
        )
        shared = cfg.moe.shared_experts * hidden
        self.shared_experts = FeedForward(cfg.dim, shared) if shared else None
        gated = shared > 0 and cfg.moe.shared_expert_gate
        self.shared_gate = nn.Linear(cfg.dim, 1, bias=False) if gated else None
        self.aux_weights = {
            "load_balance": cfg.moe.aux_loss_weight,
            "seq_balance": cfg.moe.seq_aux_loss_weight,
            "router_z": cfg.moe.router_z_loss_weight,
        }
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.register_buffer("aux_loss_sums", torch.zeros(len(AUX_LOSSES)), persistent=False)

    def forward(self, x: torch.Tensor, scale: AuxLossScale | None = None) -> torch.Tensor:
        """x (batch, seq, dim) -> (batch, seq, dim)."""
        scale = scale if scale is not None else AuxLossScale()
        tokens = x.flatten(0, -2)
        route = self.router(tokens)
        rows, per_expert, state = self.dispatcher.dispatch(tokens, route.indices)
        # Combined straight into x's shape: a view of a flat result returned from an FSDP unit
        # makes FSDP warn that gradients may be wrong (they are not, but users cannot know).
        weights = route.weights.view(*x.shape[:-1], -1)
        out = self.dispatcher.combine(self.experts(rows, per_expert), weights, state)
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(tokens))
            out = out + shared.view_as(x)
        aux_loss = self._aux_loss(route, x.shape, scale)
        if aux_loss is not None:
            out = attach_aux_loss(out, aux_loss)
        return out

    def _aux_loss(
        self, route: RouterOutput, shape: torch.Size, scale: AuxLossScale
    ) -> torch.Tensor | None:
        """The weighted, step-normalized total of the losses with a weight, in a forward that
        builds a gradient (else None); with `scale.record`, every loss is kept for the records.
        A loss neither weighted nor recorded is not computed at all."""
        grad = torch.is_grad_enabled()
        weighted = [name for name in AUX_LOSSES if grad and self.aux_weights[name] > 0]
        names = AUX_LOSSES if scale.record else weighted
        if not names:
            return None
        sums = self._loss_sums(route, scale, names, sequences=shape[0])
        tokens, sequences = route.indices.shape[0], shape[0]
        own = {"load_balance": tokens, "seq_balance": sequences, "router_z": tokens}
        if scale.record:
            self.aux_losses = {name: value.detach() / own[name] for name, value in sums.items()}
            if is_training_forward():
                self.aux_loss_sums += torch.stack([sums[name].detach() for name in AUX_LOSSES])
        given = {
            "load_balance": scale.per_token,
            "seq_balance": scale.per_sequence,
            "router_z": scale.per_token,
        }
        terms = [
            self.aux_weights[name]
            * sums[name]
            * (given[name] if given[name] is not None else 1.0 / own[name])
            for name in weighted
        ]
        return sum(terms[1:], terms[0]) if terms else None

    def _loss_sums(
        self,
        route: RouterOutput,
        scale: AuxLossScale,
        names: tuple[str, ...] | list[str],
        *,
        sequences: int,
    ) -> dict[str, torch.Tensor]:
        """The unnormalized sums of the losses `names`, and only those."""
        sums = {}
        if "load_balance" in names or "seq_balance" in names:
            probs = normalized_scores(route.scores)
        if "load_balance" in names:
            counts = route.counts
            reduce_counts = self._count_reduction(scale.reduce_counts)
            if reduce_counts is not None:
                counts = reduce_counts(counts)
            sums["load_balance"] = load_balance_sum(probs, counts)
        if "seq_balance" in names:
            experts, top_k = probs.shape[-1], route.indices.shape[-1]
            sums["seq_balance"] = sequence_balance_sum(
                probs.view(sequences, -1, experts),
                route.indices.view(sequences, -1, top_k),
                self._count_reduction(scale.reduce_sequence_counts),
            )
        if "router_z" in names:
            sums["router_z"] = router_z_sum(route.logits)
        return sums

    def _count_reduction(self, reduce: Callable | None) -> Callable | None:
        # Counts over a larger group cost a collective: only in a forward that trains (every rank
        # of the group runs the same training forwards, in one order). Also for a loss whose
        # weight is off when it is recorded: its logged value must not depend on the layout.
        return reduce if torch.is_grad_enabled() else None

    def init_buffers(self) -> None:
        self.router.init_buffers()
        self.aux_loss_sums.zero_()


@torch.no_grad()
def take_aux_loss_sums(model_parts: list[nn.Module]) -> torch.Tensor | None:
    """Every MoE block's `aux_loss_sums` since the last call, (blocks, len(AUX_LOSSES)) in the
    order of `modules()` (that of the routers), restarting them; None without MoE blocks."""
    blocks = [m for part in model_parts for m in part.modules() if isinstance(m, MoEFeedForward)]
    if not blocks:
        return None
    sums = torch.stack([block.aux_loss_sums.clone() for block in blocks])
    for block in blocks:
        block.aux_loss_sums.zero_()
    return sums
