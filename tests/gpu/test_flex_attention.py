"""Flex attention, what kiln runs on CUDA for a masked attention (kiln/model/document_mask.py),
against SDPA with the same mask made dense, forward and gradients: a causal mask, a document
mask and context parallel's mask by global positions; then a whole model on each kernel.
On the CPU kiln runs SDPA, and torch has no flex attention backward there (dry run: forward)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask

from kiln.config import ModelConfig
from kiln.model import build_model, materialize
from kiln.model import document_mask as document_mask_module
from kiln.model.document_mask import (
    attention_with_lse,
    build_document_mask,
    build_position_mask,
    document_ids,
    masked_attention,
)
from kiln.parallel.context_parallel import load_balanced_positions
from kiln.parallel.ring_attention import _block_gradients, _merge

EOS = 0
# Not a multiple of flex attention's 128-token blocks: the last block is ragged.
SEQ, BATCH, HEADS, KV_HEADS, HEAD_DIM = 300, 2, 4, 2, 64
CP = 2
MASKS = ("causal", "document", "context_parallel")
NO_CPU_BACKWARD = "torch has no flex attention backward on the CPU"
# fp32 with IEEE matmuls on both sides (torch's default: no TF32 unless asked for). The kernels
# sum up to SEQ products in different orders (flex: online softmax in blocks); each order is
# within SEQ · 2^-24 ≈ 2e-5 of the exact sum relative to the terms' magnitude, which is about 1
# for outputs (softmax-weighted averages of N(0, 1) values) and about 3 for the gradients here.
FORWARD_ATOL = 2e-5
GRADIENT_ATOL = 1e-4
# The model in bf16 (autocast, as training runs): each kernel accumulates in fp32 and rounds
# its output to bf16 once, so the two differ by at most one bf16 step (2^-8 relative) per
# element; two blocks and the head carry that on. Normwise, 2^-6 leaves 4 steps for it.
BF16_RELATIVE = 2**-6

quiet_flex = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def case(kind: str, device: torch.device, *, grad: bool) -> tuple:
    """(q, k, v, dense mask, block mask) of one mask kind, on `device`."""
    # Context parallel: the queries of cp rank 1 of 2 (chunks 1 and 2 of 4) over the keys of
    # every rank, in the order the all-gather puts them.
    generator = torch.Generator().manual_seed(MASKS.index(kind))
    tokens = torch.randint(0, 8, (BATCH, SEQ), generator=generator)  # EOS about every 8th
    # One document for the causal case: the mask is then causal alone.
    ids = (
        document_ids(tokens, EOS)
        if kind != "causal"
        else torch.zeros(BATCH, SEQ, dtype=torch.int32)
    )
    q, k, v = (
        torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=generator)
        for heads in (HEADS, KV_HEADS, KV_HEADS)
    )
    if kind == "context_parallel":
        mine = load_balanced_positions(SEQ, CP, 1)
        keys = torch.cat([load_balanced_positions(SEQ, CP, r) for r in range(CP)])
        q, k, v = q[:, :, mine], k[:, :, keys], v[:, :, keys]
        positions, key_positions, key_ids = (
            t.to(device) for t in (mine.expand(BATCH, -1), keys.expand(BATCH, -1), ids[:, keys])
        )
        build = functools.partial(
            build_position_mask, positions, key_positions, ids=ids[:, mine].to(device),
            key_ids=key_ids,
        )  # fmt: skip
    else:
        build = functools.partial(build_document_mask, ids.to(device))
    q, k, v = (t.to(device).requires_grad_(grad) for t in (q, k, v))
    return q, k, v, build(kernel="sdpa"), build(kernel="flex")


def exact_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dense: torch.Tensor
) -> torch.Tensor:
    """The reference: SDPA's math kernel, fp32 throughout."""
    with sdpa_kernel(SDPBackend.MATH):
        return masked_attention(q, k, v, dense)


@quiet_flex
@pytest.mark.parametrize("kind", MASKS)
def test_flex_forward_matches_sdpa(kind: str, device: torch.device) -> None:
    q, k, v, dense, block = case(kind, device, grad=False)
    assert isinstance(block, BlockMask) and dense.dtype == torch.bool
    with torch.no_grad():
        flex, sdpa = masked_attention(q, k, v, block), exact_sdpa(q, k, v, dense)
    assert (flex - sdpa).abs().max().item() <= FORWARD_ATOL


@pytest.mark.cuda_only(NO_CPU_BACKWARD)
@pytest.mark.parametrize("kind", MASKS)
def test_flex_gradients_match_sdpa(kind: str, device: torch.device) -> None:
    q, k, v, dense, block = case(kind, device, grad=True)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(device)
    flex_grads = torch.autograd.grad(masked_attention(q, k, v, block), (q, k, v), upstream)
    sdpa_grads = torch.autograd.grad(exact_sdpa(q, k, v, dense), (q, k, v), upstream)
    for flex, sdpa, name in zip(flex_grads, sdpa_grads, "qkv", strict=True):
        assert (flex - sdpa).abs().max().item() <= GRADIENT_ATOL, name
        assert sdpa.abs().max().item() > 100 * GRADIENT_ATOL, name  # not vacuous


MODEL = ModelConfig(
    dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_hidden_dim=512,
    max_seq_len=512,
)  # fmt: skip


def model_pass(device: torch.device, kernel: str, *, backward: bool) -> tuple:
    """Logits (and parameter gradients) of a model on packed documents, masks by `kernel`."""
    # bf16 autocast, as training runs; the model's own mask call, with the kernel fixed.
    model = materialize(build_model(MODEL), device=device, seed=0)
    tokens = torch.randint(0, 24, (BATCH, 2 * 128 + 44), generator=torch.Generator().manual_seed(5))
    tokens = tokens.to(device)  # EOS about every 24th token
    masks = functools.partial(build_document_mask, kernel=kernel)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(document_mask_module, "build_document_mask", masks)
        with torch.autocast(device.type, dtype=torch.bfloat16), torch.set_grad_enabled(backward):
            logits = model(tokens, document_ids=document_ids(tokens, EOS))
        if backward:
            logits.float().square().mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters()} if backward else {}
    return logits.detach().float(), grads


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Normwise relative difference of `a` from `b`."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@quiet_flex
@pytest.mark.needs_bf16
def test_model_logits_on_flex_match_sdpa(device: torch.device) -> None:
    flex, _ = model_pass(device, "flex", backward=False)
    sdpa, _ = model_pass(device, "sdpa", backward=False)
    assert relative(flex, sdpa) <= BF16_RELATIVE


@pytest.mark.needs_bf16
@pytest.mark.cuda_only(NO_CPU_BACKWARD)
def test_model_gradients_on_flex_match_sdpa(device: torch.device) -> None:
    flex_logits, flex = model_pass(device, "flex", backward=True)
    sdpa_logits, sdpa = model_pass(device, "sdpa", backward=True)
    assert relative(flex_logits, sdpa_logits) <= BF16_RELATIVE
    assert flex.keys() == sdpa.keys()
    for name in sdpa:
        assert relative(flex[name], sdpa[name]) <= BF16_RELATIVE, name


WINDOW = 100  # under the 300 tokens and across flex's 128-token blocks


@quiet_flex
@pytest.mark.parametrize("kind", MASKS)
def test_a_window_and_sinks_on_flex_match_the_dense_softmax(
    kind: str, device: torch.device
) -> None:
    """Sliding window and attention sinks (docs/models.md): flex's output scaled by
    σ(lse − sink) against the softmax written out with the sink as a column, fp32, forward and
    (on CUDA) gradients of q, k, v and the sinks; the bands are the ones above."""
    q, k, v, _, _ = case(kind, device, grad=device.type == "cuda")
    generator = torch.Generator().manual_seed(11)
    sinks = torch.randn(HEADS, generator=generator).to(device).requires_grad_(device.type == "cuda")
    ids = torch.zeros(BATCH, q.shape[2], dtype=torch.int32, device=device)
    if kind == "causal":  # the mask by shape alone, broadcast over the batch
        dense = build_document_mask(ids, kernel="sdpa", window=WINDOW)
        block = document_mask_module.causal_mask(SEQ, SEQ, start=0, window=WINDOW, device=device)
        if device.type != "cuda":
            block = build_document_mask(ids, kernel="flex", window=WINDOW)
    else:
        _, _, _, dense, block = case(kind, device, grad=False)
        dense, block = (_with_window(kind, device, kernel) for kernel in ("sdpa", "flex"))
    flex = masked_attention(q, k, v, block, sinks=sinks)
    written_out = masked_attention(q, k, v, dense, sinks=sinks)
    assert (flex - written_out).abs().max().item() <= FORWARD_ATOL
    if device.type != "cuda":
        return
    upstream = torch.randn(q.shape, generator=generator).to(device)
    got = torch.autograd.grad(flex, (q, k, v, sinks), upstream)
    expected = torch.autograd.grad(written_out, (q, k, v, sinks), upstream)
    for a, b, name in zip(got, expected, ("q", "k", "v", "sinks"), strict=True):
        assert (a - b).abs().max().item() <= GRADIENT_ATOL * max(1.0, b.abs().max().item()), name


def _with_window(kind: str, device: torch.device, kernel: str):
    """`case`'s document or context-parallel mask of `kind`, within WINDOW."""
    original = document_mask_module._build

    def windowed(ids, key_ids, positions, kernel_, window):
        return original(ids, key_ids, positions, kernel_, WINDOW)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(document_mask_module, "_build", windowed)
        _, _, _, dense, block = case(kind, device, grad=False)
    return dense if kernel == "sdpa" else block


@quiet_flex
def test_ring_blocks_on_flex_merge_to_attention_over_all_keys(device: torch.device) -> None:
    """What ring attention computes on each rank (kiln/parallel/ring_attention.py), its sends
    and receives aside (the CPU parity suite proves those): cp rank 1's queries over each cp
    rank's block of keys under that block's flex mask (documents: some queries see no key of a
    block, lse −inf), merged by log-sum-exp, against flex over all the keys at once; on CUDA
    the per-block gradients (flex's through its lse) summed against the whole one's. fp32; the
    bands are the ones above."""
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 8, (BATCH, SEQ), generator=generator)
    ids = document_ids(tokens, EOS).to(device)
    mine = load_balanced_positions(SEQ, CP, 1).to(device)
    blocks = [load_balanced_positions(SEQ, CP, r).to(device) for r in range(CP)]
    keys = torch.cat(blocks)
    grad = device.type == "cuda"
    q, k, v = (
        torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=generator).to(device)
        for heads in (HEADS, KV_HEADS, KV_HEADS)
    )
    q, k, v = q[:, :, mine].requires_grad_(grad), k[:, :, keys].detach(), v[:, :, keys].detach()
    k, v = k.requires_grad_(grad), v.requires_grad_(grad)

    def mask(key_positions: torch.Tensor):
        return build_position_mask(
            mine.expand(BATCH, -1), key_positions.expand(BATCH, -1), ids=ids[:, mine],
            key_ids=ids[:, key_positions], kernel="flex",
        )  # fmt: skip

    local = len(mine)
    parts = [slice(r * local, (r + 1) * local) for r in range(CP)]
    masks = [mask(block) for block in blocks]
    whole_out, whole_lse = attention_with_lse(q, k, v, mask(keys))
    out = lse = None
    with torch.no_grad():
        for part, block_mask in zip(parts, masks, strict=True):
            out_j, lse_j = attention_with_lse(q, k[:, :, part], v[:, :, part], block_mask)
            out, lse = _merge(out, lse, out_j.float(), lse_j)
    assert (out - whole_out).abs().max().item() <= FORWARD_ATOL
    # The lse here is about log(150 keys) + 1/2 ≈ 5.5, its fp32 rounding under 1e-6.
    assert (lse - whole_lse).abs().max().item() <= FORWARD_ATOL
    if not grad:
        return
    d_out = torch.randn(out.shape, generator=generator).to(device)
    d_lse = torch.randn(lse.shape, generator=generator).to(device)
    expected = torch.autograd.grad((whole_out, whole_lse), (q, k, v), (d_out, d_lse))
    d_out_dot_out = (d_out * out).sum(-1)
    d_q, d_k, d_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for part, block_mask in zip(parts, masks, strict=True):
        g_q, g_k, g_v = _block_gradients(
            q, k[:, :, part], v[:, :, part], block_mask, None, d_out, d_out_dot_out, d_lse, lse
        )
        d_q += g_q
        d_k[:, :, part], d_v[:, :, part] = g_k, g_v
    for a, b, name in zip((d_q, d_k, d_v), expected, ("q", "k", "v"), strict=True):
        assert (a - b).abs().max().item() <= GRADIENT_ATOL * max(1.0, b.abs().max().item()), name
