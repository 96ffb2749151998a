"""The gated delta rule: Gated DeltaNet's recurrent state, step by step and in chunks.

(Work in progress: the recurrent reference first; the chunked kernel follows.)
"""

from __future__ import annotations

import torch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 and narrower inputs (bf16 accumulates in fp32), fp64 kept for fp64."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    document_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule one token at a time: the reference every other kernel matches."""
    dtype, out_dtype = _compute_dtype(q), v.dtype
    batch, seq, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    q, k, v = (x.transpose(1, 2).to(dtype) for x in (q, k, v))
    decay, beta = (x.transpose(1, 2).to(dtype) for x in (g.exp(), beta))
    if document_starts is not None:
        # A zero decay at a document's first token empties the state exactly.
        decay = decay * (~document_starts)[:, None, :].to(dtype)
    state = (
        q.new_zeros(batch, heads, key_dim, value_dim)
        if initial_state is None
        else initial_state.to(dtype)
    )
    outs = []
    for t in range(seq):
        k_t, v_t = k[:, :, t], v[:, :, t]
        state = state * decay[:, :, t, None, None]
        delta = (v_t - torch.einsum("bhkv,bhk->bhv", state, k_t)) * beta[:, :, t, None]
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]) * scale)
    out = torch.stack(outs, dim=1) if outs else v.transpose(1, 2).clone()
    return out.to(out_dtype), (state if output_final_state else None)
