"""The gated delta rule's kernels (kiln/model/qwen3_next/delta_rule.py): the chunked kernel
against the step-by-step reference, forward and gradients, with states and packed documents;
both against transformers' own torch references; the short causal convolution against HF's
Conv1d; the kernel choice."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from kiln.errors import ConfigError
from kiln.model.qwen3_next import delta_rule, short_conv
from kiln.model.qwen3_next.delta_rule import (
    causal_depthwise_conv,
    chunk_gated_delta_rule,
    gated_delta_rule,
    kernel_name,
    recurrent_gated_delta_rule,
)
from kiln.model.qwen3_next.short_conv import conv_silu

BATCH, SEQ, HEADS, KEY_DIM, VALUE_DIM, CHUNK = 2, 40, 2, 8, 6, 8
SCALE = KEY_DIM**-0.5
# Row 0: a document at position 0 (the initial state is dropped), starts on chunk boundaries
# (8, 16) and inside chunks, one-token documents (13, 14) and one at the last token. Row 1:
# starts only inside chunks, so its initial state carries into the first document.
STARTS = {0: (0, 8, 13, 14, 16, 30, 39), 1: (5, 21, 22, 35)}
# fp64: both kernels compute the same sums in different orders; terms are O(1), so they agree to
# a few hundred ulps (2.2e-16) at SEQ = 40.
FP64_TOL = 1e-12
# fp32: each output and gradient sums O(SEQ) products of O(1) terms (a dot product of width 8 per
# step, then the chunk's triangular solve), so the two orders differ by about SEQ · 2^-24 ≈ 2.4e-6
# in the worst case (measured: 5e-7); 1e-5 leaves a factor 4 over that.
FP32_TOL = 1e-5


def document_starts() -> torch.Tensor:
    starts = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    for row, positions in STARTS.items():
        starts[row, list(positions)] = True
    return starts


def make_inputs(dtype: torch.dtype, seed: int = 0, seq: int = SEQ) -> list[torch.Tensor]:
    """q, k (L2-normalised), v, g (≤ 0), beta in (0, 1), an initial state; leaves for autograd."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k = (F.normalize(randn(BATCH, seq, HEADS, KEY_DIM), dim=-1) for _ in range(2))
    v = randn(BATCH, seq, HEADS, VALUE_DIM)
    g = F.logsigmoid(randn(BATCH, seq, HEADS) + 2)
    beta = torch.sigmoid(randn(BATCH, seq, HEADS))
    state = randn(BATCH, HEADS, KEY_DIM, VALUE_DIM)
    return [x.requires_grad_() for x in (q, k, v, g, beta, state)]


def run(kernel, inputs, starts=None, **options):
    """Output, final state and the gradients of a random projection of both w.r.t. every input."""
    q, k, v, g, beta, state = inputs
    out, final = kernel(
        q, k, v, g, beta, scale=SCALE, initial_state=state, output_final_state=True,
        document_starts=starts, **options,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(99)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()
    loss = loss + (final * torch.randn(final.shape, generator=gen, dtype=final.dtype)).sum()
    return [out, final, *torch.autograd.grad(loss, inputs)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_documents", [False, True])
def test_chunked_matches_recurrent(dtype, with_documents):
    starts = document_starts() if with_documents else None
    reference = run(recurrent_gated_delta_rule, make_inputs(dtype), starts)
    chunked = run(chunk_gated_delta_rule, make_inputs(dtype), starts, chunk_size=CHUNK)
    names = ["out", "final state", "dq", "dk", "dv", "dg", "dbeta", "dstate"]
    tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
    for name, ours, theirs in zip(names, chunked, reference, strict=True):
        torch.testing.assert_close(ours, theirs, atol=tol, rtol=tol, msg=name)


def test_documents_equal_separate_runs():
    """No information crosses a document start: each document alone, from a zero state (the
    first from the initial state unless a document starts at 0), gives the same outputs, and the
    final state is the last document's."""
    inputs = make_inputs(torch.float64)
    q, k, v, g, beta, state = (x.detach() for x in inputs)
    packed, final = chunk_gated_delta_rule(
        q, k, v, g, beta, scale=SCALE, initial_state=state, output_final_state=True,
        document_starts=document_starts(), chunk_size=CHUNK,
    )  # fmt: skip
    for row, positions in STARTS.items():
        for begin, end in itertools.pairwise(sorted({0, *positions, SEQ})):
            carried = begin == 0 and 0 not in positions
            part = [x[row : row + 1, begin:end] for x in (q, k, v, g, beta)]
            alone, alone_final = recurrent_gated_delta_rule(
                *part, scale=SCALE, output_final_state=True,
                initial_state=state[row : row + 1] if carried else None,
            )  # fmt: skip
            torch.testing.assert_close(packed[row, begin:end], alone[0], atol=FP64_TOL, rtol=0)
        torch.testing.assert_close(final[row], alone_final[0], atol=FP64_TOL, rtol=0)


def test_against_transformers_references():
    """transformers' torch kernels for Qwen3-Next (they compute in fp32, repeat q and k to the
    value heads with repeat_interleave and scale by key_dim^-0.5) give ours, with two value
    heads per key head repeated by the caller as kiln's layer does."""
    q, k, v, g, beta, state = (x.detach().float() for x in make_inputs(torch.float32, seq=50))
    q, k = q[:, :, :1], k[:, :, :1]
    hf_options = {"initial_state": state, "output_final_state": True}
    ours = {"initial_state": state, "output_final_state": True, "scale": SCALE}
    wide = [x.repeat_interleave(HEADS, dim=2) for x in (q, k)]
    for theirs, mine, options in (
        (hf.torch_recurrent_gated_delta_rule, recurrent_gated_delta_rule, {}),
        (hf.torch_chunk_gated_delta_rule, chunk_gated_delta_rule, {"chunk_size": 16}),
    ):
        expected = theirs(q, k, v, g, beta, **hf_options)
        got = mine(*wide, v, g, beta, **ours, **options)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=FP32_TOL, rtol=FP32_TOL)  # FP32_TOL's reason


def test_bf16_inputs_accumulate_in_fp32():
    """bf16 in, bf16 out, the state in fp32: the chunked kernel computes on the fp32 copies."""
    inputs = [x.detach() for x in make_inputs(torch.float32)]
    exact = chunk_gated_delta_rule(*inputs[:5], scale=SCALE, chunk_size=CHUNK)[0]
    low = [x.bfloat16() for x in inputs[:5]]
    out, final = chunk_gated_delta_rule(
        *low, scale=SCALE, output_final_state=True, chunk_size=CHUNK
    )
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    # The inputs' bf16 rounding (2^-9 relative) moves outputs of size O(1) by a few times that;
    # the kernel itself adds fp32 rounding only, so 3e-2 absolute is a loose upper band.
    torch.testing.assert_close(out.float(), exact, atol=3e-2, rtol=0)
    # Under bf16 autocast, as training without FSDP runs, the kernel's products stay fp32.
    with torch.autocast("cpu", torch.bfloat16):
        autocast = chunk_gated_delta_rule(*inputs[:5], scale=SCALE, chunk_size=CHUNK)[0]
    assert torch.equal(autocast, exact)


def test_kernel_choice():
    inputs = [x.detach() for x in make_inputs(torch.float32)]
    assert kernel_name("torch", "cpu") == kernel_name("auto", "cpu") == "torch"
    # fla-core runs on CUDA only: here it is either not installed or not on this device.
    with pytest.raises(ConfigError, match=r"model\.linear_attention\.kernel"):
        kernel_name("fla", "cpu")
    got = gated_delta_rule(*inputs[:5], scale=SCALE, document_starts=document_starts())
    expected = chunk_gated_delta_rule(*inputs[:5], scale=SCALE, document_starts=document_starts())
    assert torch.equal(got[0], expected[0])


def test_fla_documents_as_variable_length_sequences(monkeypatch):
    """How kiln hands packed documents to fla-core (rows end to end, one sequence per document
    and per row start, each row's state in and out): fla runs on CUDA only, so here a CPU
    stand-in with fla's contract for cu_seqlens (batch 1, one initial and final state per
    sequence) runs the reference per sequence. tests/gpu/test_delta_rule_fla.py runs fla itself."""

    def fla_varlen(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens):
        assert q.shape[0] == 1 and initial_state.shape[0] == len(cu_seqlens) - 1
        outs, finals = [], []
        for n, (begin, end) in enumerate(itertools.pairwise(cu_seqlens.tolist())):
            part = [x[:, begin:end] for x in (q, k, v, g, beta)]
            out, final = recurrent_gated_delta_rule(
                *part, scale=scale, initial_state=initial_state[n : n + 1], output_final_state=True
            )
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, dim=1), torch.cat(finals) if output_final_state else None

    monkeypatch.setattr(delta_rule, "_fla_import", lambda: fla_varlen)
    inputs = make_inputs(torch.float64)
    ours = run(delta_rule._fla_chunk, inputs, document_starts())
    reference = run(recurrent_gated_delta_rule, inputs, document_starts())
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=FP64_TOL, rtol=0)  # FP64_TOL's reason


def test_causal_depthwise_conv():
    """HF's short convolution (Conv1d over channels, groups=channels, K−1 zeros of padding, cut
    to the sequence), bit for bit; with documents, each document convolved alone."""
    channels, taps = 6, 4
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH, SEQ, channels, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, taps, generator=gen, dtype=torch.float64)
    conv = torch.nn.Conv1d(
        channels, channels, taps, groups=channels, padding=taps - 1, bias=False
    ).double()
    conv.weight.data = weight.unsqueeze(1)
    expected = conv(x.transpose(1, 2))[..., :SEQ].transpose(1, 2)
    assert torch.equal(causal_depthwise_conv(x, weight), expected)

    packed = causal_depthwise_conv(x, weight, document_starts=document_starts())
    for row, positions in STARTS.items():
        for begin, end in itertools.pairwise(sorted({0, *positions, SEQ})):
            alone = causal_depthwise_conv(x[row : row + 1, begin:end], weight)
            # fp64 sums of 4 taps in another order: a few ulps.
            torch.testing.assert_close(packed[row, begin:end], alone[0], atol=1e-14, rtol=0)


@pytest.mark.parametrize("seq", [SEQ, 2])
@pytest.mark.parametrize("with_documents", [False, True])
def test_conv_silu_keeps_its_input_only_and_differentiates_as_written_out(seq, with_documents):
    """The fused convolution + SiLU gives the written-out one's output bit for bit, and its
    gradients to fp64 rounding, with documents or without, and for fewer tokens than taps."""
    channels, taps = 6, 4
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(BATCH, seq, channels, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, taps, generator=gen, dtype=torch.float64)
    starts = document_starts()[:, :seq] if with_documents else None
    upstream = torch.randn(BATCH, seq, channels, generator=gen, dtype=torch.float64)
    results, saved = [], []
    for conv in (conv_silu, lambda *a, **k: F.silu(causal_depthwise_conv(*a, **k))):
        leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
        kept: list[torch.Tensor] = []

        def keep(tensor: torch.Tensor, kept: list[torch.Tensor] = kept) -> torch.Tensor:
            kept.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            out = conv(*leaves, document_starts=starts)
        results.append([out, *torch.autograd.grad((out * upstream).sum(), leaves)])
        saved.append(sum(t.numel() for t in kept if t.dtype == x.dtype and t.dim() == 3))
    fused, written_out = results
    assert torch.equal(fused[0], written_out[0])
    for a, b in zip(fused[1:], written_out[1:], strict=True):
        # fp64 sums of the same 4 taps' products in another order: a few ulps, IEEE on any CPU.
        torch.testing.assert_close(a, b, atol=1e-13, rtol=0)
    # The input alone, against a copy per tap with documents (and the pre-activation).
    assert saved[0] == x.numel() < saved[1]


def test_fla_convolution_gets_documents_as_variable_length_sequences(monkeypatch):
    """How kiln hands packed documents to fla-core's causal convolution (rows end to end, one
    sequence per document and per row start, weights in the input's dtype): a CPU stand-in with
    fla's contract for cu_seqlens (batch 1, the convolution restarting at each sequence) runs
    the torch convolution per sequence. tests/gpu/test_delta_rule_fla.py runs fla itself."""

    def fla_conv(x, weight, *, activation, backend, cu_seqlens=None):
        assert activation == "silu" and backend in ("cuda", "triton")
        assert x.shape[0] == 1 and weight.dtype == x.dtype
        parts = [
            F.silu(causal_depthwise_conv(x[:, begin:end], weight))
            for begin, end in itertools.pairwise(cu_seqlens.tolist())
        ]
        return torch.cat(parts, dim=1), None

    monkeypatch.setattr(short_conv, "_fla_conv_import", lambda: fla_conv)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(BATCH, SEQ, 6, generator=gen, dtype=torch.float64)
    weight = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    ours = short_conv._fla_conv_silu(x, weight, document_starts())
    expected = conv_silu(x, weight, document_starts=document_starts())
    # fp64 sums of the same 4 taps' products in another order: a few ulps, IEEE on any CPU.
    torch.testing.assert_close(ours, expected, atol=1e-13, rtol=0)
