"""The Gated DeltaNet layers under context parallel.

A cp rank holds two chunks of every sequence, chunks r and 2·cp−1−r of 2·cp (head-tail,
kiln/parallel/context_parallel.py), and a linear layer's output at a token depends on
everything before it. Two exchanges per layer bring in what a chunk needs of the earlier ones:

- the short convolution's halo: the last conv_kernel − 1 inputs of the chunk before each chunk
  (every chunk's tail all-gathered: conv_kernel − 1 tokens a chunk, whatever the length);
- the recurrent state. The state a chunk hands on is an affine function of the state it enters
  with, S_out = A·S_in + B (per value head A is key_dim × key_dim, B key_dim × value_dim; a
  document starting in the chunk makes A zero), because each value column of the state
  follows the same linear recurrence. Each rank runs its chunks once from the state [0 | I]
  with zeros appended to the values, whose final state is [B | A]; the ranks all-gather those
  maps (their size does not depend on the sequence); every rank composes them in chunk order
  into each chunk's entering state and runs its chunks again from it.

Both gathers are differentiable: the backward sums each chunk's gradients back to its owner,
so the state gradients pass to earlier chunks through the same maps. The price is the kernel
run twice, the first time with values key_dim wider.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.model.forward_args import SequenceGathers
from kiln.model.qwen3_next.delta_rule import Kernel, document_starts, gated_delta_rule
from kiln.model.qwen3_next.short_conv import conv_silu


@dataclass(frozen=True)
class ChunkLinks:
    """What a forward's Gated DeltaNet layers need under context parallel, built once per
    forward (`chunk_links`): the cp group's collectives, the document starts of this rank's
    tokens (of the whole sequences: a chunk's first token starts a document only if the token
    before it, on another rank, is of another one), and per local chunk the starts over the
    conv_kernel − 1 tokens before it (True at the first of them, and where they lie before
    the sequence)."""

    gathers: SequenceGathers
    starts: torch.Tensor  # (batch, local seq)
    halo_starts: torch.Tensor  # (batch, 2, conv_kernel − 1)

    def chunk_ids(self) -> tuple[int, int]:
        """The global chunk numbers of this rank's two chunks, in local order."""
        return self.gathers.rank, 2 * self.gathers.size - 1 - self.gathers.rank

    def by_chunk(self, pieces: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `pieces` (2, ...: one per local chunk) in global chunk order."""
        everyone = self.gathers.gather_summaries(pieces)
        size = self.gathers.size
        ordered: list[torch.Tensor | None] = [None] * (2 * size)
        for rank in range(size):
            ordered[rank], ordered[2 * size - 1 - rank] = everyone[rank].unbind(0)
        return ordered  # type: ignore[return-value]


def chunk_links(
    gathers: SequenceGathers,
    positions: torch.Tensor,
    document_ids: torch.Tensor | None,
    *,
    conv_kernel: int,
) -> ChunkLinks:
    """The links of this rank's chunks (`positions`, batch × local seq, global), from the whole
    sequences' document ids."""
    all_positions = gathers.gather_sequence(positions)
    ids = document_ids if document_ids is not None else torch.zeros_like(positions)
    all_ids = gathers.gather_sequence(ids)
    whole = torch.empty_like(all_ids).scatter_(1, all_positions, all_ids)
    whole_starts = document_starts(whole)
    local = positions.shape[1] // 2
    halo = conv_kernel - 1
    before = positions[:, ::local, None] - torch.arange(halo, 0, -1, device=positions.device)
    halo_starts = whole_starts.gather(1, before.clamp(min=0).flatten(1)).view(before.shape)
    halo_starts = halo_starts | (before < 0)
    if halo:
        halo_starts[..., 0] = True
    return ChunkLinks(gathers, whole_starts.gather(1, positions), halo_starts)


def conv_silu_across_chunks(
    x: torch.Tensor, weight: torch.Tensor, links: ChunkLinks, *, kernel: Kernel
) -> torch.Tensor:
    """`conv_silu` of this rank's two chunks (x: batch × local seq × channels), each preceded
    by the last taps − 1 inputs of the chunk before it (zeros before the sequence)."""
    halo, local = weight.shape[-1] - 1, x.shape[1] // 2
    chunks = x.split(local, dim=1)
    tails = links.by_chunk(torch.stack([chunk[:, local - halo :] for chunk in chunks]))
    outs = []
    for i, chunk_id in enumerate(links.chunk_ids()):
        before = tails[chunk_id - 1] if chunk_id > 0 else torch.zeros_like(tails[0])
        joined = torch.cat([before, chunks[i]], dim=1)
        starts = torch.cat([links.halo_starts[:, i], links.starts.split(local, 1)[i]], dim=1)
        outs.append(conv_silu(joined, weight, document_starts=starts, kernel=kernel)[:, halo:])
    return torch.cat(outs, dim=1)


def delta_rule_across_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    links: ChunkLinks,
    chunk_size: int,
    kernel: Kernel,
) -> torch.Tensor:
    """The gated delta rule over this rank's two chunks (batch × local seq × heads × width),
    each entering with the state the whole sequence before it leaves."""
    batch, seq, heads, key_dim = k.shape
    value_dim, local = v.shape[-1], seq // 2
    inputs = [x.split(local, dim=1) for x in (q, k, v, g, beta)]
    starts = links.starts.split(local, dim=1)
    options = {"scale": scale, "chunk_size": chunk_size, "kernel": kernel}
    # [0 | I] entering, zeros appended to the values: the final state is [B | A].
    identity = torch.eye(key_dim, device=q.device).expand(batch, heads, key_dim, key_dim)
    entry = torch.cat([identity.new_zeros(batch, heads, key_dim, value_dim), identity], dim=-1)
    maps = []
    for i in range(2):
        chunk_q, chunk_k, chunk_v, chunk_g, chunk_beta = (x[i] for x in inputs)
        widened = torch.cat([chunk_v, chunk_v.new_zeros(batch, local, heads, key_dim)], dim=-1)
        _, final = gated_delta_rule(
            chunk_q,
            chunk_k,
            widened,
            chunk_g,
            chunk_beta,
            initial_state=entry,
            output_final_state=True,
            document_starts=starts[i],
            **options,
        )
        maps.append(final)
    ordered = links.by_chunk(torch.stack(maps))
    entering = [torch.zeros_like(ordered[0][..., :value_dim])]
    for chunk_map in ordered[:-1]:
        offset, transfer = chunk_map.split([value_dim, key_dim], dim=-1)
        entering.append(transfer @ entering[-1] + offset)
    outs = []
    for i, chunk_id in enumerate(links.chunk_ids()):
        out, _ = gated_delta_rule(
            *(x[i] for x in inputs),
            initial_state=entering[chunk_id],
            document_starts=starts[i],
            **options,
        )
        outs.append(out)
    return torch.cat(outs, dim=1)
