"""Token losses as sums; the trainer divides by the global count of valid tokens.

`train.loss = "cross_entropy"` takes the model's logits. `"chunked_cross_entropy"` takes the final
norm's output and applies the output head itself, `train.loss_chunk_tokens` tokens at a time: each
chunk's logits exist only while that chunk's loss is computed, in forward and again in backward,
where they are recomputed (`torch.utils.checkpoint`), so at most chunk × vocab logits are held,
never tokens × vocab. It is the same loss: the sums differ only in the order of additions.

Under tensor parallel the head is split by vocabulary and the logits are vocabulary-sharded
DTensors (loss parallel: every tp rank holds every token, 1/tp of the vocabulary). Cross entropy
runs under torch's `loss_parallel()`; the z-loss's logsumexp reduces each rank's max and sum of
exponentials over the tp ranks (`_sharded_logsumexp`).

The loss is computed in fp32 from logits in the model's precision (bf16 under mixed precision).
Eager, that upcast is a copy of all the logits, 4 bytes per logit, and the cross entropy's
log-probabilities and gradients are as large: 12 bytes per logit at the loss's peak. With
`compiled` (`train.compile`), Inductor fuses the upcast into the loss's kernels: the fp32 values
exist only per element inside them, what the backward keeps is the bf16 logits and one number
per token, and the gradient comes out in the logits' dtype, 4 bytes per logit in all
(benchmarks/overhead.md, "The loss"). Vocabulary-sharded logits (loss parallel) stay eager: the
compiled graph would have to trace `loss_parallel()`'s DTensor cross entropy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from kiln.tokens import IGNORE_INDEX

LOSSES = ("cross_entropy", "chunked_cross_entropy")


def token_loss_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    z_loss_weight: float = 0.0,
    per_row: bool = False,
    compiled: bool = False,
) -> torch.Tensor:
    """Sum over valid tokens of cross entropy (+ z_loss_weight · logsumexp², which keeps logits
    from drifting); with `per_row`, one sum per sequence (batch,), e.g. to split it by dataset;
    `compiled`: through torch.compile, which keeps no fp32 copy of the logits."""
    rows = labels.shape[0]
    losses = (
        _compiled_token_losses() if compiled and not isinstance(logits, DTensor) else _token_losses
    )
    loss = losses(logits.flatten(0, -2), labels.flatten(), z_loss_weight, per_row)
    return loss.view(rows, -1).sum(dim=1) if per_row else loss


def chunked_token_loss_sum(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
    z_loss_weight: float = 0.0,
    per_row: bool = False,
) -> torch.Tensor:
    """`token_loss_sum` of the logits `hidden @ head_weight.T` (hidden: batch, seq, dim after the
    final norm; head_weight: vocab, dim), computed `chunk_tokens` tokens at a time, the last
    chunk ragged. The head's matmul runs in the caller's autocast, as it would in the model."""
    rows = labels.shape[0]
    if isinstance(hidden, DTensor):
        # Sequence parallel leaves each tp rank a part of the sequence; loss parallel needs every
        # token on every rank (as the head's ColwiseParallel gathers them in the unchunked model).
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
    chunks = zip(
        hidden.flatten(0, -2).split(chunk_tokens), labels.flatten().split(chunk_tokens), strict=True
    )
    losses = [_chunk_losses(h, head_weight, y, z_loss_weight, per_row) for h, y in chunks]
    if per_row:
        return torch.cat(losses).view(rows, -1).sum(dim=1)
    return sum(losses[1:], losses[0])


def _chunk_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    z_loss_weight: float,
    per_token: bool,
) -> torch.Tensor:
    def run(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _token_losses(F.linear(hidden, weight), labels, z_loss_weight, per_token)

    if not torch.is_grad_enabled():  # eval: nothing is kept for a backward anyway
        return run(hidden, weight)
    # Only the inputs are kept; the logits are recomputed in this chunk's backward and freed
    # after it. The backward works through the chunks one at a time, the last first.
    return checkpoint(run, hidden, weight, use_reentrant=False, preserve_rng_state=False)


def _token_losses(
    logits: torch.Tensor, labels: torch.Tensor, z_loss_weight: float, per_token: bool
) -> torch.Tensor:
    """Loss of (tokens, vocab) logits: per token (0 where ignored) or summed, in fp32."""
    logits = logits.float()
    reduction = "none" if per_token else "sum"
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction=reduction)
    if z_loss_weight > 0:
        z = _z_terms(logits, labels)
        loss = loss + z_loss_weight * (z if per_token else z.sum())
    return loss


@functools.cache
def _compiled_token_losses() -> Callable[..., torch.Tensor]:
    # Built on first use: a run without `train.compile` never loads dynamo. One graph per dtype,
    # z-loss on or off, per token or summed, and batch shape.
    return torch.compile(_token_losses)


def _z_terms(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logsumexp² of each token's logits, 0 where the label is ignored; from vocabulary-sharded
    logits a replicated DTensor, like loss parallel's cross entropy."""
    valid = labels != IGNORE_INDEX
    if not isinstance(logits, DTensor):
        return torch.logsumexp(logits, dim=-1).square() * valid
    mesh, (placement,) = logits.device_mesh, logits.placements
    if mesh.ndim != 1 or not placement.is_shard(logits.ndim - 1):
        raise ValueError(
            f"z-loss expects logits sharded by vocabulary on one mesh dim, got {logits.placements}"
        )
    lse = _sharded_logsumexp(logits.to_local(), mesh.get_group())
    return DTensor.from_local(lse.square() * valid, mesh, [Replicate()], run_check=False)


def _sharded_logsumexp(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """logsumexp over the last dim of logits whose last dim is split over `group`, from this
    rank's slice `local`: the max over all ranks (a constant: the result does not depend on it),
    then the sum of exponentials over all ranks."""
    top = local.detach().amax(dim=-1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sums = _SumOverRanks.apply((local - top.unsqueeze(-1)).exp().sum(dim=-1), group)
    return sums.log() + top


class _SumOverRanks(torch.autograd.Function):
    """All-reduce sum with the identity as backward: every rank computes the same loss from the
    sum, so each rank's gradient of the sum is already the gradient of that one loss."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        value = value.clone()
        dist.all_reduce(value, group=group)
        return value

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def count_valid_per_row(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum(dim=1)


def count_valid(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
