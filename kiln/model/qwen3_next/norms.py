"""The family's RMSNorms: zero-centred (x̂·(1 + w), Qwen3-Next's block, final and q/k norms) and
gated (x̂·w·silu(z), the Gated DeltaNet's output norm). Both compute in fp32 and return the
input's dtype, as Hugging Face's Qwen3-Next does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


class ZeroCenteredRMSNorm(nn.Module):
    """x̂·(1 + w), x̂ = x / rms(x): the weight starts at 0, so weight decay pulls the gain to 1
    rather than to 0."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def rms_norm(dim: int, eps: float, *, zero_centered: bool) -> nn.Module:
    """A zero-centred RMSNorm (model.norm_zero_centered) or torch's."""
    return ZeroCenteredRMSNorm(dim, eps) if zero_centered else nn.RMSNorm(dim, eps=eps)


class GatedRMSNorm(nn.Module):
    """rmsnorm(x)·w·silu(gate) over the last dim (one value head), the weight shared by the heads
    and starting at 1."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, *, gate: torch.Tensor) -> torch.Tensor:
        """`gate` by keyword: tensor parallel's input style lays out `x` alone. There `x` comes
        as a DTensor split by heads, so that the replicated weight's gradient is summed over the
        tp ranks' heads; the gate, this rank's heads too, joins that split."""
        if isinstance(x, DTensor) and not isinstance(gate, DTensor):
            gate = DTensor.from_local(gate, x.device_mesh, x.placements, run_check=False)
        dtype = x.dtype
        x = x.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * normed.to(dtype)) * F.silu(gate.float())).to(dtype)
