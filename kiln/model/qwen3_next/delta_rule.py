"""The gated delta rule: Gated DeltaNet's recurrent state, step by step and in chunks.

Each head keeps a state S (key_dim × value_dim). At token t, with decay α_t = exp(g_t) and
write strength β_t (Yang et al., "Gated Delta Networks"; q, k L2-normalised by the caller):

    S_t = α_t·S_{t−1} + k_t ⊗ u_t,   u_t = β_t·(v_t − α_t·S_{t−1}ᵀk_t),   o_t = scale·S_tᵀq_t

so the state first decays, then replaces what it predicts for k_t by v_t, a fraction β_t of the
way. This is transformers' `torch_recurrent_gated_delta_rule` (Qwen3-Next) with the scale given
rather than fixed at key_dim^-0.5. `recurrent_gated_delta_rule` runs it token by token: the
reference. `chunk_gated_delta_rule` computes the same thing chunk by chunk (Yang et al.,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length"). Inside a chunk of
C tokens entered with state S_0, let Γ_t be the cumulative log decay from the chunk's start to t
and D_ti = exp(Γ_t − Γ_i) for i ≤ t. Unrolling the recurrence gives
S_t = e^{Γ_t}·S_0 + Σ_{i≤t} D_ti·k_i ⊗ u_i, and substituting it into u_t gives a unit lower
triangular system for all the chunk's u at once:

    (I + A)·U = β·V − β·e^{Γ}·K·S_0,   A_ti = β_t·D_ti·k_tᵀk_i for i < t

solved for both right-hand sides by one triangular solve (the UT transform; its two solutions
are the WY representation of the chunk's product of Householder-like updates). Then
O = scale·(e^{Γ}·Q·S_0 + (QKᵀ ∘ D)·U) and the chunk hands on e^{Γ_C}·S_0 + Σ_i D_Ci·k_i ⊗ u_i.
Only the pass from chunk to chunk is sequential; everything inside a chunk is matrix products
batched over all chunks. Every exponent is a difference Γ_t − Γ_i ≤ 0 over a causal pair, so
nothing overflows.

`document_starts` (batch, seq), True at the first token of each packed document, empties the
state just before that token: α_t = 0. The recurrent reference multiplies by an exact zero; the
chunked kernel masks, by segment inside each chunk, the pairs (t, i) and the links to S_0 and
to the chunk's end that cross a start, so a document may start anywhere in a chunk and the
decays inside a document keep their fp32 precision (a large negative g instead would make
Γ_t − Γ_i a difference of large numbers). A start at position 0 drops `initial_state`.

Guarantees: both torch functions take (batch, seq, heads, width) q, k, v and (batch, seq, heads)
g ≤ 0, β; compute in fp32 (fp64 inputs in fp64, bf16 inputs accumulate in fp32); return the
output in v's dtype and the final state (batch, heads, key_dim, value_dim) in the compute dtype;
are differentiable by autograd in every input, the initial state included; turn autocast off
inside (its bf16 products would break the fp32 accumulation). They agree to
rounding (tests/unit/test_delta_rule.py: fp64 to ~1e-12, and with transformers' references).

`gated_delta_rule` runs fla-core's Triton kernel (kernel "fla", or "auto" on CUDA when fla-core
is installed) or the chunked torch one. fla takes documents only as variable-length sequences
(cu_seqlens) over a batch of one, so the rows are laid end to end, each row's initial state
enters its first sequence and its final state is its last sequence's; fla chunks by its own 64
whatever `chunk_size` says. tests/gpu/test_delta_rule_fla.py holds fla to the torch kernel.

`causal_depthwise_conv` is the short convolution before the kernel, equal to HF's
`nn.Conv1d(groups=channels, padding=K−1)(x)[..., :seq]`, with the same document resets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from kiln.errors import ConfigError

Kernel = Literal["auto", "torch", "fla"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 and narrower inputs (bf16 accumulates in fp32), fp64 kept for fp64."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _autocast_off(kernel: Callable) -> Callable:
    """Run `kernel` outside autocast: under bf16 autocast its products would round to bf16
    instead of accumulating in the compute dtype the kernel promises."""

    @functools.wraps(kernel)
    def run(q: torch.Tensor, *args, **kwargs):
        with torch.autocast(q.device.type, enabled=False):
            return kernel(q, *args, **kwargs)

    return run


@_autocast_off
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
    batch, _, heads, key_dim = k.shape
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
    # unbind rather than index per token: see chunk_gated_delta_rule.
    steps = (q, k, v, decay[..., None, None], beta[..., None])
    for q_t, k_t, v_t, decay_t, beta_t in zip(*(x.unbind(2) for x in steps), strict=True):
        state = state * decay_t
        delta = (v_t - torch.einsum("bhkv,bhk->bhv", state, k_t)) * beta_t
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q_t) * scale)
    return torch.stack(outs, dim=1).to(out_dtype), (state if output_final_state else None)


@_autocast_off
def chunk_gated_delta_rule(
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
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule chunk by chunk (UT transform inside a chunk, the state between)."""
    dtype, out_dtype = _compute_dtype(q), v.dtype
    batch, seq, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    # Padding tokens have β = 0, k = 0 and g = 0: they neither write nor decay the state.
    pad = -seq % chunk_size
    chunks = (seq + pad) // chunk_size

    def blocks(x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, heads, w) → (batch, heads, chunks, chunk_size, w) in the compute dtype."""
        x = F.pad(x.to(dtype).transpose(1, 2), (0, 0, 0, pad))
        return x.reshape(batch, heads, chunks, chunk_size, x.shape[-1])

    q, k, v = blocks(q) * scale, blocks(k), blocks(v)
    g, beta = (blocks(x.unsqueeze(-1)).squeeze(-1) for x in (g, beta))
    if document_starts is None:
        document_starts = torch.zeros(batch, seq, dtype=torch.bool, device=q.device)
    starts = F.pad(document_starts, (0, pad)).reshape(batch, 1, chunks, chunk_size)
    # segment[t]: how many documents start in the chunk up to t. Segment 0 continues the state
    # the chunk enters with; a pair (t, i) is linked only inside one segment.
    segment = starts.cumsum(-1)
    gamma = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    linked = causal & (segment.unsqueeze(-1) == segment.unsqueeze(-2))
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~linked, -torch.inf).exp()
    from_entry = gamma.masked_fill(segment != 0, -torch.inf).exp().unsqueeze(-1)
    to_exit = (gamma[..., -1:] - gamma).masked_fill(segment != segment[..., -1:], -torch.inf)
    exit_keys = k * to_exit.exp().unsqueeze(-1)
    carry = gamma[..., -1].masked_fill(segment[..., -1] != 0, -torch.inf).exp()

    k_beta = k * beta.unsqueeze(-1)
    # solve_triangular with unitriangular reads only the strictly lower part: A of the docstring.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    solved = torch.linalg.solve_triangular(
        system,
        torch.cat([v * beta.unsqueeze(-1), k_beta * from_entry], dim=-1),
        upper=False,
        unitriangular=True,
    )
    u_fresh, u_from_state = solved.split([value_dim, key_dim], dim=-1)
    scores = (q @ k.transpose(-1, -2)) * decay
    entry_queries = q * from_entry

    state = (
        q.new_zeros(batch, heads, key_dim, value_dim)
        if initial_state is None
        else initial_state.to(dtype)
    )
    per_chunk = (u_fresh, u_from_state, entry_queries, scores, exit_keys, carry[..., None, None])
    out, state = _carry_state_through_chunks(per_chunk, state)
    out = out.reshape(batch, heads, chunks * chunk_size, value_dim)
    out = out[:, :, :seq].transpose(1, 2).to(out_dtype)
    return out, (state if output_final_state else None)


# Eager inside a compiled block: traced, the loop unrolls into one copy per chunk, so the graph
# and its compile time grow with seq / chunk_size and every sequence length recompiles; its few
# products per chunk gain nothing from fusion. The work batched over chunks before it compiles.
@torch.compiler.disable
def _carry_state_through_chunks(
    per_chunk: tuple[torch.Tensor, ...], state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequential part of the chunked kernel: each chunk's output and the state it hands on."""
    outs = []
    # unbind, not indexing per chunk: the backward of an index writes a zero-filled gradient the
    # size of the whole tensor for every chunk, quadratic in seq; unbind's stacks them once.
    for fresh, from_state, queries, chunk_scores, keys, chunk_carry in zip(
        *(x.unbind(2) for x in per_chunk), strict=True
    ):
        u = fresh - from_state @ state
        outs.append(queries @ state + chunk_scores @ u)
        state = state * chunk_carry + keys.transpose(-1, -2) @ u
    return torch.stack(outs, dim=2), state


def gated_delta_rule(
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
    chunk_size: int = 64,
    kernel: Kernel = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule on the kernel `kernel_name(kernel, q.device)` names; `chunk_size` is
    the torch kernel's."""
    args = (q, k, v, g, beta)
    options = {
        "scale": scale,
        "initial_state": initial_state,
        "output_final_state": output_final_state,
        "document_starts": document_starts,
    }
    if kernel_name(kernel, q.device) == "fla":
        return _fla_chunk(*args, **options)
    if q.shape[1] == 1:  # a generation step: one token, not a chunk padded to chunk_size
        return recurrent_gated_delta_rule(*args, **options)
    return chunk_gated_delta_rule(*args, **options, chunk_size=chunk_size)


def kernel_name(kernel: Kernel, device: torch.device | str) -> str:
    """The kernel `kernel` runs on `device`, "fla" or "torch" ("auto": fla on CUDA if installed)."""
    device = torch.device(device)
    if kernel == "torch":
        return "torch"
    if kernel == "auto":
        return "fla" if device.type == "cuda" and _fla_import() is not None else "torch"
    if kernel != "fla":
        raise ValueError(f"unknown linear attention kernel {kernel!r}; expected auto, torch or fla")
    if _fla_import() is None:
        raise ConfigError(
            "model.linear_attention.kernel = 'fla' but fla-core is not installed: "
            "`pip install fla-core`, or set model.linear_attention.kernel = 'torch'"
        )
    if device.type != "cuda":
        raise ConfigError(
            f"model.linear_attention.kernel = 'fla' runs on CUDA only, not on {device.type}; "
            "set model.linear_attention.kernel = 'auto' or 'torch'"
        )
    return "fla"


@functools.cache
def _fla_import() -> Callable | None:
    """fla-core's chunked gated delta rule, or None when fla-core is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except ImportError:
        return None
    return fla_chunk


# Eager inside a compiled block: fla's kernels are Triton already, and the documents' cu_seqlens
# have a data-dependent length, which would break the graph there anyway.
@torch.compiler.disable
def _fla_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    document_starts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla-core's kernel; documents become its variable-length sequences (cu_seqlens)."""
    fla_chunk = _fla_import()
    assert fla_chunk is not None, "kernel_name resolved to fla without fla-core"
    options = {"scale": scale, "output_final_state": output_final_state}
    if document_starts is None:
        return fla_chunk(q, k, v, g, beta, initial_state=initial_state, **options)
    # The row's state enters its first sequence (unless a document starts there) and leaves
    # from its last.
    batch, seq = document_starts.shape
    cu_seqlens, row_first, row_last = fla_sequences(document_starts)
    states = None
    if initial_state is not None:
        kept = initial_state * (~document_starts[:, 0]).to(initial_state.dtype)[:, None, None, None]
        states = initial_state.new_zeros(len(cu_seqlens) - 1, *initial_state.shape[1:])
        states = states.index_copy(0, row_first, kept)
    flat_args = (x.reshape(1, batch * seq, *x.shape[2:]) for x in (q, k, v, g, beta))
    out, final = fla_chunk(*flat_args, initial_state=states, cu_seqlens=cu_seqlens, **options)
    out = out.reshape(batch, seq, *out.shape[2:])
    return out, (final[row_last] if final is not None else None)


def fla_sequences(
    document_starts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fla-core takes documents only as variable-length sequences over a batch of one: the rows
    laid end to end, each row's first token starting a sequence too. Returns cu_seqlens and,
    per row, the index of its first and of its last sequence."""
    batch, seq = document_starts.shape
    begins = document_starts.clone()
    begins[:, 0] = True
    flat = begins.reshape(-1)
    cu_seqlens = F.pad(flat.nonzero().squeeze(1), (0, 1), value=batch * seq)
    sequence_index = flat.long().cumsum(0) - 1
    row_first = sequence_index[::seq]
    row_last = torch.cat([row_first[1:], row_first.new_tensor([len(cu_seqlens) - 1])]) - 1
    return cu_seqlens, row_first, row_last


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq) bool: True at position 0 and where a token's document differs from the
    previous token's: where the Gated DeltaNet layers start afresh."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def causal_depthwise_conv(
    x: torch.Tensor, weight: torch.Tensor, *, document_starts: torch.Tensor | None = None
) -> torch.Tensor:
    """out_t = Σ_{j<K} weight[:, K−1−j]·x_{t−j} over earlier tokens of the same document.

    x (batch, seq, channels), weight (channels, K): HF's Conv1d weight (channels, 1, K) squeezed.
    Without documents this is F.conv1d with HF's padding, bit for bit; with them each shift's
    tokens from an earlier document are zeroed (the kernel is a handful of taps, K = 4).
    """
    seq, taps = x.shape[1], weight.shape[-1]
    if document_starts is None:
        out = F.conv1d(
            x.transpose(1, 2), weight.unsqueeze(1), padding=taps - 1, groups=weight.shape[0]
        )
        return out[..., :seq].transpose(1, 2)
    document = document_starts.long().cumsum(1)
    out = x * weight[:, -1]
    for shift in range(1, min(taps, seq)):
        earlier = F.pad(x[:, :-shift], (0, 0, shift, 0))
        same = F.pad(document[:, :-shift], (shift, 0), value=-1) == document
        out = out + earlier * same.unsqueeze(-1) * weight[:, taps - 1 - shift]
    return out
