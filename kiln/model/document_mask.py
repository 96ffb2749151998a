"""Attention that stays inside each document of a packed sequence (data.document_mask).

Packed windows hold several documents, each ended by an EOS token. A query attends to earlier
keys of its own document only. The mask is built once per batch from the document ids and shared
by every layer; which kernel runs it is decided in `_build`.

Under context parallel a rank's queries are some chunks of the sequence and its keys the whole
sequence, gathered in rank order: `build_position_mask` masks by global positions instead of by
index (kiln/parallel/context_parallel.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from kiln.model.forward_args import SequenceGathers

Kernel = Literal["auto", "sdpa", "flex"]
# A boolean (batch, 1, queries, keys) mask for SDPA, or a block-sparse mask for flex attention.
DocumentMask = torch.Tensor | BlockMask


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(batch, seq) int32 index of the document each position belongs to: the number of EOS
    tokens strictly before it, so an EOS belongs to the document it ends. Windows that start
    mid-document simply count that document as 0."""
    is_eos = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(is_eos, dim=1, dtype=torch.int32) - is_eos


def build_document_mask(ids: torch.Tensor, kernel: Kernel = "auto") -> DocumentMask:
    """Causal, same-document mask for document ids of shape (batch, seq).

    "auto" picks flex attention on CUDA: its block mask skips whole blocks across documents and
    never holds a (seq × seq) mask per sample in GPU memory. Elsewhere (CPU, i.e. tests and CI)
    SDPA with a dense boolean mask is simple and exact, and memory there is no concern.
    """
    return _build(ids, ids, None, kernel)


def build_position_mask(
    positions: torch.Tensor,
    key_positions: torch.Tensor,
    *,
    ids: torch.Tensor | None = None,
    key_ids: torch.Tensor | None = None,
    kernel: Kernel = "auto",
) -> DocumentMask:
    """Causal mask by global position for queries at `positions` (batch, queries) over keys at
    `key_positions` (batch, keys), and within documents when `ids` and `key_ids` are given:
    context parallel's local queries against the keys of the whole sequence, in any order."""
    if ids is None:
        ids, key_ids = torch.zeros_like(positions), torch.zeros_like(key_positions)
    return _build(ids, key_ids, (positions, key_positions), kernel)


def _build(
    ids: torch.Tensor,
    key_ids: torch.Tensor,
    positions: tuple[torch.Tensor, torch.Tensor] | None,
    kernel: Kernel,
) -> DocumentMask:
    """`positions` None: queries and keys are the same tokens, in sequence order."""
    if kernel == "auto":
        kernel = "flex" if ids.device.type == "cuda" else "sdpa"
    if kernel == "sdpa":
        return _dense_mask(ids, key_ids, positions)
    if kernel == "flex":
        return _block_mask(ids, key_ids, positions)
    raise ValueError(f"unknown attention kernel {kernel!r}; expected 'auto', 'sdpa' or 'flex'")


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: DocumentMask,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Grouped-query attention of (batch, heads, seq, head_dim) tensors under `mask`; `scale`:
    the softmax's (None: 1 / sqrt(head_dim))."""
    if isinstance(mask, BlockMask):
        # Inside a compiled block, flex attention compiles with the block; called eagerly on
        # CUDA it needs its own compile.
        standalone = q.device.type == "cuda" and not torch.compiler.is_compiling()
        flex = _compiled(flex_attention) if standalone else flex_attention
        return flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


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
) -> torch.Tensor:
    if positions is None:
        order = torch.arange(ids.shape[1], device=ids.device)
        causal = order[:, None] >= order[None, :]
    else:
        causal = positions[0][:, :, None] >= positions[1][:, None, :]
    same_document = ids[:, :, None] == key_ids[:, None, :]
    return (causal & same_document).unsqueeze(1)


def _block_mask(
    ids: torch.Tensor,
    key_ids: torch.Tensor,
    positions: tuple[torch.Tensor, torch.Tensor] | None,
) -> BlockMask:
    batch, queries = ids.shape
    keys = key_ids.shape[1]

    def causal_same_document(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids[b, q_idx] == key_ids[b, kv_idx])

    def causal_by_position_same_document(b, h, q_idx, kv_idx):
        earlier = positions[0][b, q_idx] >= positions[1][b, kv_idx]
        return earlier & (ids[b, q_idx] == key_ids[b, kv_idx])

    mask_mod = causal_same_document if positions is None else causal_by_position_same_document
    # On CPU flex runs eagerly (tests only), so the compile would cost more than it saves.
    create = _compiled(create_block_mask) if ids.device.type == "cuda" else create_block_mask
    # H=None: one mask for all heads, also for the slice of heads a tensor-parallel rank holds.
    return create(mask_mod, batch, None, queries, keys, device=ids.device)


def layer_mask(
    document_ids: torch.Tensor | None,
    positions: torch.Tensor | None,
    context_parallel: SequenceGathers | None,
) -> DocumentMask | None:
    """The mask every layer of a forward shares; None: plain causal attention over whole
    sequences. With `positions` (context parallel) the keys are the whole sequence's."""
    if positions is None:
        return build_document_mask(document_ids) if document_ids is not None else None
    key_positions, key_ids = positions, document_ids
    if context_parallel is not None:
        key_positions = context_parallel.gather_sequence(positions)
        if document_ids is not None:
            key_ids = context_parallel.gather_sequence(document_ids)
    return build_position_mask(positions, key_positions, ids=document_ids, key_ids=key_ids)
