"""The Gated DeltaNet's short convolution with its SiLU, keeping only its input for backward.

Written out, the convolution over packed documents keeps one masked copy of its input per tap
and the SiLU its pre-activation: five copies of the layer's widest rows (queries, keys and
values, 2·(key width) + value width per token) at 4 taps. The torch function keeps the input
alone and recomputes the few multiply-adds per channel in backward, as fused kernels do; its
forward is `silu(causal_depthwise_conv(...))`, bit for bit.

On CUDA with fla-core installed (the kernel choice of delta_rule.py, "auto" or "fla") the
convolution is fla-core's `causal_conv1d`, which runs the causal-conv1d package's CUDA kernel
when that is installed (`backend="cuda"`) and fla's Triton kernel otherwise; documents go to it
as variable-length sequences, as to fla's delta rule. tests/gpu/test_delta_rule_fla.py holds
it to the torch function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln.model.qwen3_next.delta_rule import (
    Kernel,
    causal_depthwise_conv,
    fla_sequences,
    kernel_name,
)


def conv_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    document_starts: torch.Tensor | None = None,
    kernel: Kernel = "torch",
) -> torch.Tensor:
    """silu(causal_depthwise_conv(x, weight, document_starts=...)): x (batch, seq, channels),
    weight (channels, taps), document_starts (batch, seq) True at each document's first token;
    on the kernel `kernel_name(kernel, x.device)` names."""
    if kernel_name(kernel, x.device) == "fla":
        return _fla_conv_silu(x, weight, document_starts)
    return _ConvSilu.apply(x, weight, document_starts)


@functools.cache
def conv_backend_name() -> str:
    """What runs fla-core's convolution: the causal-conv1d package's kernel when it imports
    (fla's "cuda" backend calls it), fla's Triton kernel otherwise."""
    try:
        import causal_conv1d  # noqa: F401
    except ImportError:
        return "fla (Triton)"
    return "causal-conv1d"


@functools.cache
def _fla_conv_import() -> Callable | None:
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        return None
    return causal_conv1d


# Eager inside a compiled block, as fla's delta rule (delta_rule.py's _fla_chunk).
@torch.compiler.disable
def _fla_conv_silu(
    x: torch.Tensor, weight: torch.Tensor, document_starts: torch.Tensor | None
) -> torch.Tensor:
    """fla-core's causal convolution with SiLU; documents as its variable-length sequences."""
    causal_conv1d = _fla_conv_import()
    assert causal_conv1d is not None, "kernel_name resolved to fla without fla-core"
    backend = "cuda" if conv_backend_name() == "causal-conv1d" else "triton"
    # One dtype for both, as the torch path's autocast conv1d computes.
    weight = weight.to(x.dtype)
    if document_starts is None:
        return causal_conv1d(x, weight, activation="silu", backend=backend)[0]
    batch, seq, channels = x.shape
    cu_seqlens, _, _ = fla_sequences(document_starts)
    flat = x.reshape(1, batch * seq, channels)
    out, _ = causal_conv1d(flat, weight, activation="silu", backend=backend, cu_seqlens=cu_seqlens)
    return out.reshape(batch, seq, channels)


def _same_document(document: torch.Tensor | None, shift: int) -> torch.Tensor | None:
    """(batch, seq, 1): whether token t − shift exists and is of t's document (None: no
    documents, every earlier token counts; the zero padding of the shift drops the rest)."""
    if document is None:
        return None
    return (F.pad(document[:, :-shift], (shift, 0), value=-1) == document).unsqueeze(-1)


def _shifted(x: torch.Tensor, shift: int) -> torch.Tensor:
    """x_{t − shift} at t, zeros before the first token; shift may be negative (later tokens)."""
    if shift >= 0:
        return F.pad(x[:, : x.shape[1] - shift], (0, 0, shift, 0))
    return F.pad(x[:, -shift:], (0, 0, 0, -shift))


class _ConvSilu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, document_starts):
        out = causal_depthwise_conv(x, weight, document_starts=document_starts)
        ctx.save_for_backward(x, weight, document_starts)
        return F.silu(out)

    @staticmethod
    def backward(ctx, grad):
        x, weight, document_starts = ctx.saved_tensors
        seq, taps = x.shape[1], weight.shape[-1]
        # The backward in fp32 (fp64 kept): the pre-activation again, then the SiLU's slope.
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        x32, w32 = x.to(dtype), weight.to(dtype)
        pre = causal_depthwise_conv(x32, w32, document_starts=document_starts)
        sigmoid = torch.sigmoid(pre)
        grad_pre = grad.to(dtype) * sigmoid * (1 + pre * (1 - sigmoid))
        document = None if document_starts is None else document_starts.long().cumsum(1)
        grad_x = grad_pre * w32[:, -1]
        grad_w = torch.empty_like(w32)
        grad_w[:, -1] = (grad_pre * x32).sum((0, 1))
        # Tap K−1−s reads the token s before: its gradient goes back s tokens, where the same
        # document links the two.
        for shift in range(1, taps):
            if shift >= seq:
                grad_w[:, taps - 1 - shift] = 0
                continue
            same = _same_document(document, shift)
            earlier = _shifted(x32, shift)
            later_grad = _shifted(grad_pre, -shift)
            if same is not None:
                earlier = earlier * same
                later_grad = later_grad * _shifted(same.to(dtype), -shift)
            grad_w[:, taps - 1 - shift] = (grad_pre * earlier).sum((0, 1))
            grad_x = grad_x + later_grad * w32[:, taps - 1 - shift]
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None
