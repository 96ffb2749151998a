"""Attention that stays inside each document of a packed sequence (data.document_mask).

Packed windows hold several documents, each ended by an EOS token. A query attends to earlier
keys of its own document only. The mask is built once per batch from the document ids and shared
by every layer; which kernel runs it is decided in `build_document_mask`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

Kernel = Literal["auto", "sdpa", "flex"]
# A boolean (batch, 1, seq, seq) mask for SDPA, or a block-sparse mask for flex attention.
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
    if kernel == "auto":
        kernel = "flex" if ids.device.type == "cuda" else "sdpa"
    if kernel == "sdpa":
        return _dense_mask(ids)
    if kernel == "flex":
        return _block_mask(ids)
    raise ValueError(f"unknown attention kernel {kernel!r}; expected 'auto', 'sdpa' or 'flex'")


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask
) -> torch.Tensor:
    """Grouped-query attention of (batch, heads, seq, head_dim) tensors under `mask`."""
    if isinstance(mask, BlockMask):
        # Inside a compiled block, flex attention compiles with the block; called eagerly on
        # CUDA it needs its own compile.
        standalone = q.device.type == "cuda" and not torch.compiler.is_compiling()
        flex = _compiled(flex_attention) if standalone else flex_attention
        return flex(q, k, v, block_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """Eager flex attention and eager create_block_mask materialize the full (seq × seq) scores
    or mask; compiled, they are fused, block-sparse kernels. Compiled on first use, not at
    import, which would cost every `kiln` command a second of compiler imports."""
    return torch.compile(fn)


def _dense_mask(ids: torch.Tensor) -> torch.Tensor:
    seq = ids.shape[1]
    positions = torch.arange(seq, device=ids.device)
    causal = positions[:, None] >= positions[None, :]
    same_document = ids[:, :, None] == ids[:, None, :]
    return (causal & same_document).unsqueeze(1)


def _block_mask(ids: torch.Tensor) -> BlockMask:
    batch, seq = ids.shape

    def causal_same_document(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids[b, q_idx] == ids[b, kv_idx])

    # On CPU flex runs eagerly (tests only), so the compile would cost more than it saves.
    create = _compiled(create_block_mask) if ids.device.type == "cuda" else create_block_mask
    # H=None: one mask for all heads, also for the slice of heads a tensor-parallel rank holds.
    return create(causal_same_document, batch, None, seq, seq, device=ids.device)
