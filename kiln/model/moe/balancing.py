"""Load-balancing losses of the router and how they reach the gradient.

Each loss is written as a sum (over tokens or over sequences) and normalized like the main
loss: by a count over the whole optimizer step (all micro-batches, all data ranks) that the
trainer sets through `AuxLossScale` before the forwards. Left unset, the normalization is this
forward's own count, so one forward is exactly the paper's formula.

The weighted total enters the gradient through `attach_aux_loss`: the identity on the MoE
block's output in forward, and in backward the gradient of the total as well. The output is
never changed, so every pipeline schedule, gradient accumulation and activation checkpointing
carries the auxiliary gradient along with the main loss's backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.model.moe.router import count_values


@dataclass
class AuxLossScale:
    """The normalization of the auxiliary losses of the next forwards (see module doc).

    per_token multiplies the sums over tokens (load balance, z-loss); per_sequence the sum
    over sequences (sequence-wise balance). Typically 1 / (tokens resp. sequences of the
    optimizer step), times what the main loss's scale also carries (FSDP's average
    compensation). None: 1 / this forward's own count.
    reduce_counts, if set, maps this forward's assignments per expert (experts,) to the counts
    over a larger group (a sum over the ranks holding the other tokens of the micro-batch: data
    and tensor-parallel ranks), from which the load-balance loss takes its f_e; None: this
    forward's counts.
    reduce_sequence_counts, if set, does the same for the assignments per (sequence, expert)
    of the sequence-wise loss, summed over the ranks holding the other parts of the same
    sequences (tensor-parallel ranks); None: this forward holds whole sequences.
    With reduced counts each rank's sum covers its own tokens only: the sums over all ranks
    add up to the loss of the whole micro-batch, and so do the gradients, which the trainer
    sums over the same ranks.
    record: the forwards keep every loss, weighted or not, for the step's records (the trainer
    sets it at the steps it logs); False: only the losses with a weight are computed, and only
    in a forward that builds a gradient.
    """

    per_token: float | torch.Tensor | None = None
    per_sequence: float | torch.Tensor | None = None
    reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None
    reduce_sequence_counts: Callable[[torch.Tensor], torch.Tensor] | None = None
    record: bool = False


def load_balance_sum(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer (Fedus et al. 2021, eq. 4; GShard's for top-k) auxiliary loss as a sum
    over tokens: E · Σ_e f_e · Σ_t p_{t,e}, where f_e = counts_e / Σ counts is the fraction of the
    routed assignments that went to e (the fraction of tokens routed to e, divided by k) and
    p_{t,e} the router probability. Divided by the number of tokens T it is E · Σ_e f_e · P_e
    with P_e = mean_t p_{t,e}: 1 when perfectly balanced.

    probs (tokens, experts), counts (experts,) of the assignments (maybe over a larger group).
    """
    fraction = counts.float() / counts.sum().clamp(min=1)
    return probs.shape[-1] * (fraction * probs.sum(dim=0)).sum()


def sequence_balance_sum(
    probs: torch.Tensor,
    indices: torch.Tensor,
    reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """DeepSeek-V3 (2024, eqs. 17-20) sequence-wise balance loss, summed over sequences:
    Σ_b Σ_e f_{b,e} · P_{b,e} with f_{b,e} = E / (k · S) · (assignments of sequence b to e) and
    P_{b,e} = mean over the sequence's S tokens of the normalized score s'_{t,e}. Divided by the
    number of sequences it is the paper's loss averaged over sequences (α is the weight).

    probs (sequences, seq_len, experts) normalized scores, indices (sequences, seq_len, top_k).
    `reduce_counts` (see `AuxLossScale.reduce_sequence_counts`): these tokens are a part of
    each sequence; the counts of the whole sequences give f and S, and the sum covers this
    part's tokens, so the parts' sums add up to the loss of the whole sequences.
    """
    sequences, _, experts = probs.shape
    top_k = indices.shape[-1]
    # Exact integer counts per (sequence, expert), whatever the order of accumulation.
    flat = indices.flatten(1) + experts * torch.arange(sequences, device=indices.device)[:, None]
    counts = count_values(flat, sequences * experts).view(sequences, -1)
    if reduce_counts is not None:
        counts = reduce_counts(counts)
    # k · S: every token of a whole sequence makes k assignments (before any capacity drop).
    assignments = counts.sum(dim=1, keepdim=True).float()
    fraction = counts.float() * experts / assignments
    return (fraction * probs.sum(dim=1) * (top_k / assignments)).sum()


def router_z_sum(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE (Zoph et al. 2022, eq. 5) router z-loss as a sum over tokens: Σ_t
    logsumexp(logits_t)²; divided by the number of tokens it is the paper's mean."""
    return torch.logsumexp(logits.float(), dim=-1).square().sum()


def normalized_scores(scores: torch.Tensor) -> torch.Tensor:
    """Scores scaled to sum 1 over the experts (DeepSeek-V3's s'); for a softmax router they are
    its probabilities up to rounding."""
    return scores / scores.sum(dim=-1, keepdim=True)


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype = aux_loss.dtype
        # An input returned as it is becomes a view of it, and FSDP warns about a unit that
        # returns a view; a detached alias shares the storage (no copy) and is no view.
        return output.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # d(main loss + aux_loss) / d aux_loss = 1: the normalization is already in aux_loss.
        return grad_output, torch.ones((), dtype=ctx.aux_dtype, device=grad_output.device)


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """`output` unchanged, with the gradient of the scalar `aux_loss` added to the backward that
    passes through it."""
    return _AttachAuxLoss.apply(output, aux_loss)
