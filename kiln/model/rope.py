"""Rotary position embeddings in the half-split layout (the one Hugging Face Llama checkpoints use),
optionally with Llama 3.1's or YaRN's (DeepSeek-V3) frequency scaling for long contexts."""

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


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction for a context stretched by `factor` (1 when not stretched)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al. 2023) as DeepSeek-V3 uses it: frequencies that turn more than beta_fast
    times over the original context keep their wavelength, those turning fewer than beta_slow
    times are stretched by `factor`, a linear ramp over the rotary dimensions between them
    blends the two; cos and sin are scaled by mscale's correction over mscale_all_dim's."""

    factor: float
    original_max_seq_len: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    theta: float
    truncate: bool = True  # the ramp's ends rounded to whole dimensions (gpt-oss: not)

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        width = 2 * inv_freq.shape[0]

        def dimension_of(turns: float) -> float:
            # The rotary dimension whose frequency turns `turns` times over the original context.
            wavelengths = self.original_max_seq_len / (turns * 2 * math.pi)
            return width * math.log(wavelengths) / (2 * math.log(self.theta))

        low, high = dimension_of(self.beta_fast), dimension_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, width - 1)
        high = high + 0.001 if low == high else high
        pairs = torch.arange(inv_freq.shape[0], device=inv_freq.device, dtype=torch.float32)
        stretched = ((pairs - low) / (high - low)).clamp(0.0, 1.0)
        return inv_freq / self.factor * stretched + inv_freq * (1 - stretched)

    @property
    def table_scale(self) -> float:
        """The factor on cos and sin (1 for DeepSeek-V3, whose mscale equals mscale_all_dim)."""
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor, 1.0)


def model_rope_tables(
    cfg: ModelConfig, device: torch.device | str | None, *, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables of a model: plain RoPE, or with the scaling `cfg.rope_scaling` names.
    `width`: the rotary width, when it is not the head's (MLA's qk_rope_head_dim)."""
    width = width or cfg.resolved_head_dim
    scaling: Llama3Scaling | YarnScaling | None = None
    if cfg.rope_scaling == "llama3":
        scaling = Llama3Scaling(
            cfg.rope_scaling_factor,
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
            cfg.rope_original_max_seq_len,
        )
    elif cfg.rope_scaling == "yarn":
        scaling = YarnScaling(
            factor=cfg.rope_scaling_factor,
            original_max_seq_len=cfg.rope_original_max_seq_len,
            beta_fast=cfg.rope_yarn_beta_fast,
            beta_slow=cfg.rope_yarn_beta_slow,
            mscale=cfg.rope_yarn_mscale,
            mscale_all_dim=cfg.rope_yarn_mscale_all_dim,
            theta=cfg.rope_theta,
            truncate=cfg.rope_yarn_truncate,
        )
    return rope_tables(width, cfg.max_seq_len, cfg.rope_theta, device, scaling=scaling)


def rope_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | str | None,
    *,
    scaling: Llama3Scaling | YarnScaling | None = None,
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
    if isinstance(scaling, YarnScaling) and scaling.table_scale != 1.0:
        return angles.cos() * scaling.table_scale, angles.sin() * scaling.table_scale
    return angles.cos(), angles.sin()


def rope_at(
    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables a forward hands its blocks: whole (max_seq_len, width), each attention
    taking its tokens' rows (`token_rows`); or at context parallel's `positions` (batch, seq),
    indexed already as (batch, 1, seq, width) to broadcast over the heads."""
    if positions is None:
        return cos, sin
    return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def token_rows(
    cos: torch.Tensor, sin: torch.Tensor, *, start: int, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of `rope_at`'s tables for `seq` tokens from position `start` (a generation
    cache's); tables at given positions pass through. Sliced in attention: under sequence
    parallel only attention sees whole sequences."""
    if cos.ndim == 2:
        return cos[start : start + seq], sin[start : start + seq]
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (batch, heads, seq, head_dim) by the tables already sliced to its positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
