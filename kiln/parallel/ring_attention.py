"""Ring attention (distributed.cp_mode = "ring"): context parallel without gathering the
sequence's keys and values.

Each of the cp ranks holds its own tokens' queries, keys and values. In cp steps it attends its
queries to one block of keys and values, its own first, then the block of the rank before it,
and so on, while the block it holds is already on its way to the next rank (an asynchronous
send and receive, overlapped with the step's attention). The partial outputs are merged by
their log-sum-exp: with L = logaddexp(l, l_j), out = out·e^(l − L) + out_j·e^(l_j − L).

The backward passes the blocks around the ring again. Each block's gradient accumulates as the
block travels and arrives home at the end, so no rank ever holds more than two blocks of keys
and values (the one it attends and the one arriving) and two of their gradients. Nothing of the
other ranks' keys and values is kept for the backward, only what attention over the rank's own
keys would keep (its q, k, v, output and log-sum-exp): each step recomputes its block's
attention (one attention forward more per layer than the all-gather) and back-propagates
through it with the weights the merge gave it. With o_j, l_j a block's output and lse and w_j =
e^(l_j − L) its weight, out = Σ w_j·o_j and L = log Σ e^(l_j), so the block receives
∂/∂o_j = w_j·dout and ∂/∂l_j = w_j·(⟨dout, o_j − out⟩ + dL).

Any kernel that returns a differentiable log-sum-exp serves (`attention_with_lse`: flex
attention on CUDA, the softmax written out on the CPU), under any mask built by position:
causal, within documents, within a window; the masks come one per block of keys
(`layer_masks`). Partial outputs and gradients add up in fp32 (or the inputs' dtype if wider),
and the gradients travel so, so that the cp − 1 additions round in fp32, not bf16.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kiln.model.document_mask import DocumentMask, attention_with_lse


class Ring:
    """This rank's neighbours in its cp group: it sends to the next rank and receives from the
    one before."""

    def __init__(self, group: dist.ProcessGroup, *, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.previous = dist.get_global_rank(group, (rank - 1) % size)

    def pass_on(self, tensor: torch.Tensor) -> _InFlight:
        """Send `tensor` to the next rank and receive the previous rank's in its place, without
        waiting."""
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, tensor, self.next, self.group),
                dist.P2POp(dist.irecv, received, self.previous, self.group),
            ]
        )
        return _InFlight(received, works)


class _InFlight:
    """A block on its way: the buffer it lands in and the send and receive to wait for."""

    def __init__(self, received: torch.Tensor, works: list):
        self.received, self.works = received, works

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


@torch.compiler.disable  # point-to-point sends inside an autograd.Function: run eagerly
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masks: tuple[DocumentMask, ...],
    *,
    ring: Ring,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries (batch, heads, local seq, width) over every cp rank's
    keys and values, `masks[r]` masking the block of rank r; the output and its log-sum-exp
    (fp32), both differentiable."""
    assert len(masks) == ring.size, "one mask per cp rank's block of keys"
    return _RingAttention.apply(q, k, v, masks, ring, scale)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, masks, ring, scale):
        width = k.shape[-1]
        blocks = torch.cat([k, v], dim=-1).contiguous()
        out = lse = None
        for step in range(ring.size):
            arriving = ring.pass_on(blocks) if step < ring.size - 1 else None
            key, value = blocks.split([width, blocks.shape[-1] - width], dim=-1)
            source = (ring.rank - step) % ring.size
            out_j, lse_j = attention_with_lse(q, key, value, masks[source], scale=scale)
            out, lse = _merge(out, lse, out_j.to(_accumulated(q)), lse_j)
            if arriving is not None:
                blocks = arriving.wait()
        # The output as returned (bf16 under autocast), not its fp32 sum: half the bytes, and
        # the rounding FlashAttention's backward also accepts in ⟨dout, out⟩.
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.masks, ctx.ring, ctx.scale = masks, ring, scale
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        ring, width = ctx.ring, k.shape[-1]
        out = out.to(_accumulated(q))
        d_out = torch.zeros_like(out) if d_out is None else d_out.to(out.dtype)
        d_lse = torch.zeros_like(lse) if d_lse is None else d_lse
        # ⟨dout, out⟩ per query, the part of ⟨dout, o_j − out⟩ every block shares.
        d_out_dot_out = (d_out * out).sum(-1)
        blocks = torch.cat([k, v], dim=-1).contiguous()
        d_q = torch.zeros_like(q, dtype=out.dtype)
        d_blocks = returning = None
        for step in range(ring.size):
            arriving = ring.pass_on(blocks) if step < ring.size - 1 else None
            source = (ring.rank - step) % ring.size
            key, value = blocks.split([width, blocks.shape[-1] - width], dim=-1)
            grads = _block_gradients(
                q, key, value, ctx.masks[source], ctx.scale, d_out, d_out_dot_out, d_lse, lse
            )
            d_q += grads[0]
            # This block's gradient so far travels with it: zeros for this rank's own block,
            # else what the previous rank added.
            d_blocks = torch.zeros_like(blocks, dtype=out.dtype) if step == 0 else returning.wait()
            d_blocks += torch.cat(grads[1:], dim=-1)
            returning = ring.pass_on(d_blocks)
            if arriving is not None:
                blocks = arriving.wait()
        # After cp steps the gradient of this rank's own block comes back from the previous one.
        d_k, d_v = returning.wait().split([width, blocks.shape[-1] - width], dim=-1)
        return d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), None, None, None


def _merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, out_j: torch.Tensor, lse_j: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax-normalized partial results over disjoint keys, as one."""
    if out is None:
        return out_j, lse_j
    merged = torch.logaddexp(lse, lse_j)
    # A query no block has shown a key yet: both weights exp(-inf - 0) = 0, not NaN.
    reference = merged.masked_fill(merged == float("-inf"), 0)
    out = out * torch.exp(lse - reference).unsqueeze(-1) + out_j * torch.exp(
        lse_j - reference
    ).unsqueeze(-1)
    return out, merged


def _block_gradients(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: DocumentMask,
    scale: float | None,
    d_out: torch.Tensor,
    d_out_dot_out: torch.Tensor,
    d_lse: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (in `d_out`'s dtype) of q and of one block's keys and values: its attention recomputed
    and back-propagated with the weight the merge gave it."""
    with torch.enable_grad():
        q, key, value = (t.detach().requires_grad_() for t in (q, key, value))
        out_j, lse_j = attention_with_lse(q, key, value, mask, scale=scale)
        # 0 where this block showed a query no key (and where no block did: lse -inf).
        weight = torch.exp(lse_j.detach() - lse.masked_fill(lse == float("-inf"), 0))
        d_out_dot_block = (d_out * out_j.detach().to(d_out.dtype)).sum(-1)
        d_lse_j = weight * (d_out_dot_block - d_out_dot_out + d_lse)
        d_out_j = (d_out * weight.unsqueeze(-1)).to(out_j.dtype)
        grads = torch.autograd.grad((out_j, lse_j), (q, key, value), (d_out_j, d_lse_j))
    return tuple(g.to(d_out.dtype) for g in grads)


def _accumulated(x: torch.Tensor) -> torch.dtype:
    """The dtype partial results and gradients add up in: fp32, or the inputs' if wider."""
    return torch.promote_types(x.dtype, torch.float32)
