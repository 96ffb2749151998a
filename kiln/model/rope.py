"""Rotary position embeddings in the half-split layout (the one Hugging Face Llama checkpoints use),
optionally with Llama 3.1's frequency scaling for long contexts."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kiln.config.sections import ModelConfig


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's rule: rotations slower than the original context keep their wavelength
    stretched by `factor`, fast ones (local word order) stay as trained, and the band between
    `original_max_seq_len / low_freq_factor` and `/ high_freq_factor` blends the two."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        # How many full turns each frequency makes over the original context, placed on the
        # [low_freq_factor, high_freq_factor] band: 0 -> stretch fully, 1 -> keep as is.
        turns = self.original_max_seq_len * inv_freq / (2 * math.pi)
        keep = (
            (turns - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        ).clamp(0.0, 1.0)
        return inv_freq * ((1 - keep) / self.factor + keep)


def model_rope_tables(
    cfg: ModelConfig, device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables of a model: plain RoPE, or with the scaling `cfg.rope_scaling` names."""
    scaling = (
        Llama3Scaling(
            cfg.rope_scaling_factor,
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
            cfg.rope_original_max_seq_len,
        )
        if cfg.rope_scaling == "llama3"
        else None
    )
    return rope_tables(
        cfg.resolved_head_dim, cfg.max_seq_len, cfg.rope_theta, device, scaling=scaling
    )


def rope_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | str | None,
    *,
    scaling: Llama3Scaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, head_dim), fp32."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim)
    )
    if scaling is not None:
        inv_freq = scaling.apply(inv_freq)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.int64).float()
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (batch, heads, seq, head_dim) by the tables already sliced to its positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
