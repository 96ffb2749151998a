"""Attention that stays inside each document of a packed sequence (data.document_mask), and
within a sliding window (model.sliding_window), with or without attention sinks.

Packed windows hold several documents, each ended by an EOS token. A query attends to earlier
keys of its own document only, and under a window to the last `window` of them (itself
included). The masks are built once per batch from the document ids, one per window the layers
use; which kernel runs them is decided in `_build`. Without document ids a window's mask depends
only on the shapes and is built once (`causal_mask`).

Under context parallel a rank's queries are some chunks of the sequence and its keys the whole
sequence, gathered in rank order (or, for ring attention, each cp rank's block of keys in turn):
`build_position_mask` masks by global positions instead of by index
(kiln/parallel/context_parallel.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    create_block_mask,
    flex_attention,
)

from kiln.model.forward_args import SequenceGathers

Kernel = Literal["auto", "sdpa", "flex"]
# A boolean (batch, 1, queries, keys) mask for SDPA, or a block-sparse mask for flex attention.
DocumentMask = torch.Tensor | BlockMask
# What a layer is given: one mask, or (ring attention) one per cp rank's block of keys.
LayerMask = DocumentMask | tuple[DocumentMask, ...]


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(batch, seq) int32 index of the document each position belongs to: the number of EOS
    tokens strictly before it, so an EOS belongs to the document it ends. Windows that start
    mid-document simply count that document as 0."""
    is_eos = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(is_eos, dim=1, dtype=torch.int32) - is_eos


def build_document_mask(
    ids: torch.Tensor, kernel: Kernel = "auto", *, window: int = 0
) -> DocumentMask:
    """Causal, same-document mask for document ids of shape (batch, seq), within `window`
    (0: none).

    "auto" picks flex attention on CUDA: its block mask skips whole blocks across documents and
    never holds a (seq × seq) mask per sample in GPU memory. Elsewhere (CPU, i.e. tests and CI)
    SDPA with a dense boolean mask is simple and exact, and memory there is no concern.
    """
    return _build(ids, ids, None, kernel, window)


def build_position_mask(
    positions: torch.Tensor,
    key_positions: torch.Tensor,
    *,
    ids: torch.Tensor | None = None,
    key_ids: torch.Tensor | None = None,
    kernel: Kernel = "auto",
    window: int = 0,
) -> DocumentMask:
    """Causal mask by global position for queries at `positions` (batch, queries) over keys at
    `key_positions` (batch, keys), and within documents when `ids` and `key_ids` are given:
    context parallel's local queries against the keys of the whole sequence, in any order
    (a window is by position too, so it reaches across the chunks a rank holds)."""
    if ids is None:
        ids, key_ids = torch.zeros_like(positions), torch.zeros_like(key_positions)
    return _build(ids, key_ids, (positions, key_positions), kernel, window)


def _build(
    ids: torch.Tensor,
    key_ids: torch.Tensor,
    positions: tuple[torch.Tensor, torch.Tensor] | None,
    kernel: Kernel,
    window: int,
) -> DocumentMask:
    """`positions` None: queries and keys are the same tokens, in sequence order."""
    if kernel == "auto":
        kernel = "flex" if ids.device.type == "cuda" else "sdpa"
    if kernel == "sdpa":
        return _dense_mask(ids, key_ids, positions, window)
    if kernel == "flex":
        return _block_mask(ids, key_ids, positions, window)
    raise ValueError(f"unknown attention kernel {kernel!r}; expected 'auto', 'sdpa' or 'flex'")


@functools.lru_cache(maxsize=16)
def causal_mask(
    queries: int, keys: int, *, start: int, window: int, device: torch.device
) -> DocumentMask:
    """The mask of queries at positions start..start+queries over keys 0..keys without
    document ids: causal, within `window` (0: none). It depends only on the shapes, so every
    layer and step of one shape shares it; one mask for every sequence of a batch."""
    if device.type == "cuda":

        def mask_mod(b, h, q_idx, kv_idx):
            behind = q_idx + start - kv_idx
            return (behind >= 0) & (behind < window) if window else behind >= 0

        # B and H None: broadcast over the batch and the heads.
        return _compiled(create_block_mask)(mask_mod, None, None, queries, keys, device=device)
    # Key j is visible to query i when i + start - window < j <= i + start: two diagonals of a
    # boolean matrix, with no (queries × keys) matrix of position differences on the way.
    visible = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(start)
    return (visible.triu(start - window + 1) if window else visible)[None, None]


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: DocumentMask,
    *,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention of (batch, heads, seq, head_dim) tensors under `mask`; `scale`:
    the softmax's (None: 1 / sqrt(head_dim)); `sinks`: one logit per head (of these heads)
    that joins every query's softmax with no value of its own."""
    if isinstance(mask, BlockMask):
        if sinks is not None:
            return with_sinks(*attention_with_lse(q, k, v, mask, scale=scale), sinks)
        return _flex(q)(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
    if sinks is not None:
        return _dense_attention_with_sinks(q, k, v, mask, scale=scale, sinks=sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: DocumentMask,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`masked_attention`'s output and each query's log-sum-exp of its scores (batch, heads,
    queries; fp32 or wider): -inf, with an output of zeros, for a query that sees no key under `mask`.
    Both differentiable: attention sinks and ring attention's merge of blocks use the lse."""
    if isinstance(mask, BlockMask):
        out, aux = _flex(q)(
            q, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True)
        )
        return out, aux.lse
    # SDPA returns no lse: the softmax written out, the kernel of CPU runs, where the scores of
    # a sequence fit in memory.
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    at_least_fp32 = torch.promote_types(q.dtype, torch.float32)
    scores = (q @ k.transpose(-1, -2)).to(at_least_fp32) * (scale or q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # A row with no visible key: weights exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
    weights = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    return weights.to(v.dtype) @ v, lse


def _dense_attention_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float | None,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """The softmax written out with the sink as one more column (SDPA has no place for it):
    the kernel of CPU runs, where the scores of a sequence fit in memory. One softmax, as one
    process computes it; ring attention, which merges blocks, joins the sinks by the lse
    (`with_sinks`) instead."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * (scale or q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return weights.to(v.dtype) @ v


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention's output with one sink logit per head joined to every query's softmax: each
    weight shrinks by Z / (Z + e^sink), Z = e^lse, i.e. by σ(lse − sink)."""
    kept = torch.sigmoid(lse - sinks.view(1, -1, 1).to(lse.dtype))
    return out * kept.unsqueeze(-1).to(out.dtype)


def _flex(q: torch.Tensor) -> Callable:
    """Flex attention: inside a compiled block it compiles with the block; called eagerly on
    CUDA it needs its own compile."""
    standalone = q.device.type == "cuda" and not torch.compiler.is_compiling()
    return _compiled(flex_attention) if standalone else flex_attention


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """Eager flex attention and eager create_block_mask materialize the full (seq × seq) scores
    or mask; compiled, they are fused, block-sparse kernels. Compiled on first use, not at
    import, which would cost every `kiln` command a second of compiler imports."""
    return torch.compile(fn)


def _dense_mask(
    ids: torch.Tensor,
    key_ids: torch.Tensor,
    positions: tuple[torch.Tensor, torch.Tensor] | None,
    window: int,
) -> torch.Tensor:
    if positions is None:
        order = torch.arange(ids.shape[1], device=ids.device)
        behind = order[:, None] - order[None, :]
    else:
        behind = positions[0][:, :, None] - positions[1][:, None, :]
    visible = (behind >= 0) & (behind < window) if window else behind >= 0
    same_document = ids[:, :, None] == key_ids[:, None, :]
    return (visible & same_document).unsqueeze(1)


def _block_mask(
    ids: torch.Tensor,
    key_ids: torch.Tensor,
    positions: tuple[torch.Tensor, torch.Tensor] | None,
    window: int,
) -> BlockMask:
    batch, queries = ids.shape
    keys = key_ids.shape[1]

    def visible(behind):
        return (behind >= 0) & (behind < window) if window else behind >= 0

    def causal_same_document(b, h, q_idx, kv_idx):
        return visible(q_idx - kv_idx) & (ids[b, q_idx] == key_ids[b, kv_idx])

    def causal_by_position_same_document(b, h, q_idx, kv_idx):
        behind = positions[0][b, q_idx] - positions[1][b, kv_idx]
        return visible(behind) & (ids[b, q_idx] == key_ids[b, kv_idx])

    mask_mod = causal_same_document if positions is None else causal_by_position_same_document
    # On CPU flex runs eagerly (tests only), so the compile would cost more than it saves.
    create = _compiled(create_block_mask) if ids.device.type == "cuda" else create_block_mask
    # H=None: one mask for all heads, also for the slice of heads a tensor-parallel rank holds.
    return create(mask_mod, batch, None, queries, keys, device=ids.device)


def layer_masks(
    document_ids: torch.Tensor | None,
    positions: torch.Tensor | None,
    context_parallel: SequenceGathers | None,
    *,
    windows: tuple[int, ...] = (0,),
) -> dict[int, LayerMask] | None:
    """The masks the layers of a forward share, one per window they use (0: none); None: no
    mask from the data (plain causal attention over whole sequences, or a mask that depends
    only on the shapes, `causal_mask`). With `positions` (context parallel) the keys are the
    whole sequence's, in one mask or (ring) one per cp rank's block of keys."""
    if positions is None:
        if document_ids is None:
            return None
        return {w: build_document_mask(document_ids, window=w) for w in windows}
    key_positions, key_ids, blocks = positions, document_ids, 1
    if context_parallel is not None:
        key_positions = context_parallel.gather_sequence(positions)
        if document_ids is not None:
            key_ids = context_parallel.gather_sequence(document_ids)
        # The queries a rank attends with: its own tokens, or (all-to-all) the whole sequence's.
        positions = context_parallel.query_sequence(positions, key_positions)
        if document_ids is not None:
            document_ids = context_parallel.query_sequence(document_ids, key_ids)
        blocks = context_parallel.key_blocks
    position_blocks = key_positions.chunk(blocks, dim=1)
    id_blocks = key_ids.chunk(blocks, dim=1) if key_ids is not None else (None,) * blocks

    def window_masks(window: int) -> LayerMask:
        masks = tuple(
            build_position_mask(positions, p, ids=document_ids, key_ids=i, window=window)
            for p, i in zip(position_blocks, id_blocks, strict=True)
        )
        return masks[0] if blocks == 1 else masks

    return {w: window_masks(w) for w in windows}
