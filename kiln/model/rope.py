"""Rotary position embeddings in the half-split layout (the one Hugging Face Llama checkpoints use)."""

from __future__ import annotations

import torch


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, head_dim), fp32."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim)
    )
    positions = torch.arange(max_seq_len, device=device, dtype=torch.int64).float()
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (batch, heads, seq, head_dim) by the tables already sliced to its positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
