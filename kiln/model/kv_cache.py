"""Preallocated key/value cache for incremental decoding."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        *,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        device,
        dtype,
        value_dim: int = 0,
    ):
        """`value_dim`: the width of a value head when it is not `head_dim` (multi-head latent
        attention's keys are qk_nope + qk_rope wide, its values v_head_dim); 0: head_dim."""
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros((*shape[:-1], value_dim or head_dim), device=device, dtype=dtype)
        self.pos = 0
        self.max_len = max_len

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values for `layer`; return all keys/values so far."""
        end = self.pos + k.shape[2]
        assert end <= self.max_len, "KV cache overflow"
        self.k[layer, :, :, self.pos : end] = k
        self.v[layer, :, :, self.pos : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        self.pos += n


def prefix_causal_mask(seq: int, start: int, device: torch.device) -> torch.Tensor | None:
    """Mask for queries at positions start..start+seq over keys 0..start+seq; None where
    is_causal or no mask suffices (a forward from position 0, or one token)."""
    if start == 0 or seq == 1:
        return None
    rows = torch.arange(start, start + seq, device=device)[:, None]
    return torch.arange(start + seq, device=device)[None, :] <= rows
