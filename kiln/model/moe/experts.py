"""The routed experts: one SwiGLU per expert, their weights stacked into 3-D parameters.

Tokens arrive sorted by expert with the count of each, and each expert multiplies its own
contiguous rows. `torch._grouped_mm` does all experts in one call; where it does not apply
(other dtypes, rows not 16-byte aligned) an explicit loop over the experts does the same.

What `torch._grouped_mm` is in torch 2.13. On CPU: a C++ loop calling `mm` on each group's
rows (`_grouped_mm_fallback`), so it equals the Python loop bit for bit, forward and backward
(tested). On CUDA, read from the torch source and not run here (no GPU): a grouped kernel for
bf16 on sm90/sm100, the same per-group loop otherwise. It wants int32 end offsets,
fp32/bf16/fp16 operands of one dtype (not fp64) and row strides that are multiples of 16 bytes;
it does not autocast, so the compute dtype is chosen here. Under torch.compile its meta kernel
accepts bf16 only, so compiled fp32 experts take the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Activation:
    """The experts' gated activation of the gate h1 and up h3 projections: SwiGLU,
    silu(h1) · h3, or gpt-oss's clamped SwiGLU, (clamp(h3, ±limit) + 1) · g · sigmoid(alpha · g)
    with g = clamp(h1, max=limit)."""

    clamped: bool = False
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, h1: torch.Tensor, h3: torch.Tensor) -> torch.Tensor:
        if not self.clamped:
            return F.silu(h1) * h3
        gate = h1.clamp(max=self.limit)
        up = h3.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * torch.sigmoid(self.alpha * gate)


class GroupedExperts(nn.Module):
    """w1, w3: (experts, hidden, dim); w2: (experts, dim, hidden); expert e computes
    w2[e] @ act(w1[e] @ x, w3[e] @ x), like `FeedForward`'s w2(silu(w1 x) * w3 x); with `bias`,
    b1, b3 (experts, hidden) and b2 (experts, dim) are added after their projections."""

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden_dim: int,
        *,
        use_grouped_mm: bool = True,
        bias: bool = False,
        activation: Activation = Activation(),
    ):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        if bias:
            self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.b3 = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.b2 = nn.Parameter(torch.empty(num_experts, dim))
        self.bias, self.activation = bias, activation
        # False: always the per-expert loop (a reference, or a kernel to compare against).
        self.use_grouped_mm = use_grouped_mm

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x (tokens, dim) sorted by expert, tokens_per_expert (experts,) -> (tokens, dim)."""
        dtype = compute_dtype(x)
        x = x.to(dtype)
        w1, w3, w2 = (_local(w).to(dtype) for w in (self.w1, self.w3, self.w2))
        biases = (
            tuple(_local(b).to(dtype) for b in (self.b1, self.b3, self.b2)) if self.bias else None
        )
        if self.use_grouped_mm and grouped_mm_applies(x, w1, w2):
            return _grouped(x, w1, w3, w2, tokens_per_expert, biases, self.activation)
        return _looped(x, w1, w3, w2, tokens_per_expert, biases, self.activation)


def _local(weight: torch.Tensor) -> torch.Tensor:
    # Under expert parallel the weights are DTensors split over the experts: this rank's
    # experts are its local slice, and the tokens it receives are for those.
    return weight.to_local() if isinstance(weight, DTensor) else weight


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype where autocast is on (grouped_mm ignores autocast), else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def grouped_mm_applies(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` accepts these operands: a supported dtype and rows of the
    tokens, the hidden activations and the (transposed) weights aligned to 16 bytes."""
    if x.dtype not in GROUPED_MM_DTYPES or not x.is_contiguous():
        return False
    # torch.compile traces with the op's meta kernel, which accepts bf16 only.
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    alignment = 16 // x.element_size()
    dim, hidden = w2.shape[1], w1.shape[1]
    return dim % alignment == 0 and hidden % alignment == 0 and w1.is_contiguous()


def _grouped(x, w1, w3, w2, tokens_per_expert: torch.Tensor, biases, act) -> torch.Tensor:
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    h1 = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
    h3 = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    if biases is not None:
        # Each row's expert, without reading the counts on the host.
        experts = torch.arange(len(tokens_per_expert), device=x.device)
        rows = torch.repeat_interleave(experts, tokens_per_expert, output_size=x.shape[0])
        b1, b3, b2 = (b[rows] for b in biases)
        h1, h3 = h1 + b1, h3 + b3
    out = torch._grouped_mm(act(h1, h3), w2.transpose(-2, -1), offs=offsets)
    return out + b2 if biases is not None else out


# Eager even inside a compiled block: the loop's bounds are the token counts, data that
# changes every step, and compiled it would recompile for each new count.
@torch.compiler.disable
def _looped(x, w1, w3, w2, tokens_per_expert: torch.Tensor, biases, act) -> torch.Tensor:
    # Every expert runs, an empty one on zero rows, so that each gets a gradient (zeros) even
    # when no token reached it.
    outputs, start = [], 0
    for expert, count in enumerate(tokens_per_expert.tolist()):
        rows = x[start : start + count]
        h1, h3 = rows @ w1[expert].transpose(0, 1), rows @ w3[expert].transpose(0, 1)
        if biases is not None:
            h1, h3 = h1 + biases[0][expert], h3 + biases[1][expert]
        out = act(h1, h3) @ w2[expert].transpose(0, 1)
        outputs.append(out + biases[2][expert] if biases is not None else out)
        start += count
    return torch.cat(outputs)
