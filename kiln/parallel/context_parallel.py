"""Context parallel: each sequence split over the `cp` ranks, attention over all of it.

Every cp rank reads the same micro-batches (cp ranks are not data ranks) and keeps its part of
each sequence: the sequence is cut into 2·cp chunks and rank i keeps chunks i and 2·cp−1−i. Under
a causal mask a query's work grows with its position, so pairing an early chunk with a late one
gives every rank the same work (head–tail balancing, as Llama 3's training did).

Everything per token (embedding, feed-forward, norms, loss) then runs on the local tokens only.
Attention needs every key, in one of three ways (`distributed.cp_mode`):

- `all_gather`: each layer all-gathers its post-RoPE keys and values over cp (one collective for
  both; autograd turns it into a reduce-scatter in backward) and attends with its local queries.
- `ring`: the keys and values go from rank to rank, one block per step, overlapped with the
  attention of the block at hand; the partial results merge by log-sum-exp (ring_attention.py).
- `all_to_all` (DeepSpeed-Ulysses): each layer re-splits its queries, keys and values from
  the sequence to the heads (an all-to-all each), attends over the whole sequence with 1/cp of
  the heads, and re-splits the output back to the sequence.

Every way the mask is built from global positions and document ids. The model applies RoPE at
the global positions `shard_batch` adds to its inputs, and gathers those positions and the
document ids once per forward to build the mask for every layer. The training step passes a
`ContextParallel` to the model's forward (`context_parallel=`), which hands it to its layers.

cp ranks hold different tokens, so their gradients are summed like data ranks' (FSDP shards over
dp_shard × ep × cp, see mesh.py) and their valid tokens join the loss's global count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives
from torch.distributed.device_mesh import DeviceMesh

from kiln.config.sections import CpMode
from kiln.model.document_mask import LayerMask, masked_attention, with_sinks
from kiln.model.parallel_plan import ParallelPlan, blocks_of
from kiln.parallel.ring_attention import Ring, ring_attention

# The differentiable all-gather along dim 0: torch 2.13 names it `all_gather_single_autograd`,
# torch 2.11 `all_gather_tensor_autograd` (a feature check, not a version check).
_all_gather_autograd = getattr(
    _functional_collectives,
    "all_gather_single_autograd",
    getattr(_functional_collectives, "all_gather_tensor_autograd", None),
)


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: the all-gather's backward (a
    reduce-scatter) needs one on torch 2.11 ("Expected input.is_contiguous()"), and the gradient
    of the gathered keys and values arrives permuted (`movedim`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def load_balanced_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions cp rank `rank` holds of a sequence of `seq_len`: chunks `rank` and
    2·cp−1−`rank` of 2·cp equal chunks, in that order."""
    assert seq_len % (2 * cp) == 0, "validation guarantees seq_len divisible by 2·cp"
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([head, tail])


class ContextParallel:
    """This rank's place in its cp group: what it keeps of a batch, and the gathers the model's
    attention calls."""

    def __init__(self, cp_mesh: DeviceMesh, *, mode: CpMode = "all_gather"):
        self.group, self.mode = cp_mesh.get_group(), mode
        self.size, self.rank = cp_mesh.size(), cp_mesh.get_local_rank()
        self.key_blocks = self.size if mode == "ring" else 1
        self.ring = Ring(self.group, rank=self.rank, size=self.size) if mode == "ring" else None

    def shard_batch(
        self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's tokens of (batch, seq) inputs, labels and per-token model arguments
        (document ids computed on the whole sequences), plus their global `positions`.

        Positions are per sequence (batch, seq / cp), like every model argument, so that a
        pipeline schedule splits them into micro-batches along with the inputs."""
        batch, seq = inputs.shape
        positions = load_balanced_positions(seq, self.size, self.rank).to(inputs.device)
        local = {name: value[:, positions] for name, value in kwargs.items()}
        local["positions"] = positions.expand(batch, -1)
        return inputs[:, positions], labels[:, positions], local

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: LayerMask,
        *,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of this rank's queries, keys and values (batch, heads, local seq, width)
        over the whole sequences, under `mask` (one per cp rank's keys for the ring); the output
        for this rank's tokens and every head. `sinks`: one logit per head."""
        if self.mode == "ring":
            out, lse = ring_attention(q, k, v, mask, ring=self.ring, scale=scale)
            return out if sinks is None else with_sinks(out, lse, sinks)
        if self.mode == "all_gather":
            return masked_attention(q, *self.gather_kv(k, v), mask, scale=scale, sinks=sinks)
        q, k, v = (self._to_heads(t) for t in (q, k, v))
        own_sinks = sinks.chunk(self.size)[self.rank] if sinks is not None else None
        out = masked_attention(q, k, v, mask, scale=scale, sinks=own_sinks)
        return self._to_sequence(out)

    def query_sequence(self, values: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        """Per-token integers of the queries this rank attends with, given its own (`values`)
        and the whole sequences' (`gathered`, from `gather_sequence`): its own tokens'
        (all_gather, ring) or all of them (all_to_all)."""
        return gathered if self.mode == "all_to_all" else values

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads, local seq, width) -> (batch, heads / cp, seq, width): head group r to
        rank r, every rank's tokens in rank order (differentiable: the backward is the inverse
        all-to-all)."""
        batch, heads, local, width = x.shape
        parts = x.reshape(batch, self.size, heads // self.size, local, width).movedim(1, 0)
        received = _all_to_all(parts.contiguous(), self.group)  # [r]: rank r's tokens
        return received.movedim(0, 2).reshape(batch, heads // self.size, self.size * local, width)

    def _to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `_to_heads`: (batch, heads / cp, seq, width) -> (batch, heads, local
        seq, width)."""
        batch, group_heads, seq, width = x.shape
        local = seq // self.size
        parts = x.reshape(batch, group_heads, self.size, local, width).movedim(2, 0)
        received = _all_to_all(parts.contiguous(), self.group)  # [r]: head group r
        return received.movedim(0, 1).reshape(batch, self.size * group_heads, local, width)

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (batch, heads, local seq, width) of the whole sequences: every cp
        rank's, in rank order, in one all-gather; the backward sums each rank's gradient back to
        its owner (reduce-scatter). Keys and values may differ in width (MLA)."""
        both = torch.cat([k, v], dim=-1).movedim(2, 0).contiguous()
        gathered = _ContiguousGradient.apply(_all_gather_autograd(both, 0, self.group))
        k, v = gathered.movedim(0, 2).split([k.shape[-1], v.shape[-1]], dim=-1)
        return k, v

    def gather_summaries(self, x: torch.Tensor) -> torch.Tensor:
        """Every cp rank's `x` (one shape on all), stacked in rank order along a new dim 0; the
        backward sums each rank's gradient back to its owner. For what a layer's chunks hand
        on to later ones (a linear layer's state maps and convolution inputs), not the
        sequence itself."""
        gathered = _all_gather_autograd(x.unsqueeze(0).contiguous(), 0, self.group)
        return _ContiguousGradient.apply(gathered)

    @torch.no_grad()
    def gather_sequence(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token integers (batch, local seq) of the whole sequences, in the order of
        `gather_kv`'s keys: for the attention mask (positions, document ids)."""
        parts = [torch.empty_like(values) for _ in range(self.size)]
        dist.all_gather(parts, values.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Slice r of dim 0 to rank r, rank r's slice back into place r; differentiable."""
    out = _functional_collectives.all_to_all_single_autograd(x, None, None, group)
    return _ContiguousGradient.apply(out)


def check_context_parallel(model: nn.Module, plan: ParallelPlan) -> None:
    """The family's attention gathers the other parts of the sequence (its forward takes
    `context_parallel`, which the training step passes); a plan that names no attention layer
    says it cannot."""
    blocks = blocks_of(model, plan)
    layers = [path for block in blocks for path in plan.block_attention(block.module)]
    if blocks and not layers:
        raise ValueError(
            f"{type(model).__name__} names no attention layer for context parallel in its plan; "
            "set distributed.cp = 1"
        )
