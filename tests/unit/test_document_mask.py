"""Document masking: attention never crosses a document boundary of a packed sequence."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from kiln.config import ModelConfig
from kiln.model import KVCache, build_model, materialize
from kiln.model import document_mask as mask_module
from kiln.model.document_mask import build_document_mask, document_ids, masked_attention

EOS = 0
CFG = ModelConfig(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=97,
    ffn_hidden_dim=96,
    max_seq_len=256,
    qk_norm=True,
)

# Eager flex attention on CPU warns that it is unfused; that is expected in these tests.
quiet_flex = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def make_model():
    return materialize(build_model(CFG), device="cpu", seed=0)


def document(length: int, seed: int) -> torch.Tensor:
    """A document of `length` tokens, the last one EOS."""
    body = torch.randint(
        1, CFG.vocab_size, (length - 1,), generator=torch.Generator().manual_seed(seed)
    )
    return torch.cat([body, torch.tensor([EOS])])


def test_document_ids_keep_eos_with_its_document():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, 8], [EOS, EOS, 3, 4, 5, 6]])
    expected = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 2, 2, 2, 2]], dtype=torch.int32)
    assert torch.equal(document_ids(tokens, EOS), expected)


def test_document_ids_of_a_window_that_starts_mid_document():
    # The window opens inside a document: its tail up to the EOS is document 0.
    tokens = torch.tensor([[7, 8, EOS, 9, EOS, EOS, 4]])
    expected = torch.tensor([[0, 0, 0, 1, 1, 2, 3]], dtype=torch.int32)
    assert torch.equal(document_ids(tokens, EOS), expected)


def test_dense_mask_is_causal_within_documents():
    ids = document_ids(torch.tensor([[1, EOS, 2, 3]]), EOS)
    mask = build_document_mask(ids, "sdpa")
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=bool)
    assert mask.shape == (1, 1, 4, 4)
    assert torch.equal(mask[0, 0], expected)


def test_auto_kernel_on_cpu_is_sdpa_and_unknown_kernels_are_refused():
    ids = torch.zeros(2, 8, dtype=torch.int32)
    assert isinstance(build_document_mask(ids), torch.Tensor)
    with pytest.raises(ValueError, match="unknown attention kernel"):
        build_document_mask(ids, "flash")


def test_packed_documents_match_each_document_alone():
    """Rotary attention depends only on relative positions, so the second document needs no
    position reset: packed at offset 40 it gives the logits it gives alone at offset 0."""
    model = make_model()
    first, second = document(40, seed=1), document(60, seed=2)
    packed = torch.cat([first, second])[None]
    with torch.no_grad():
        masked = model(packed, document_ids=document_ids(packed, EOS))
        alone_first, alone_second = model(first[None]), model(second[None])
        unmasked = model(packed)
    assert (masked[:, :40] - alone_first).abs().max() <= 1e-5
    assert (masked[:, 40:] - alone_second).abs().max() <= 1e-5
    # The checks have teeth: without the mask the second document sees the first, and positions
    # do change the logits (with rotation switched off they differ), so the offset was exercised.
    assert (unmasked[:, 40:] - alone_second).abs().max() > 1e-3
    model.rope_cos.fill_(1.0)
    model.rope_sin.zero_()
    with torch.no_grad():
        no_rotation = model(second[None])
    assert (no_rotation - alone_second).abs().max() > 1e-3


def test_one_document_equals_plain_causal_attention():
    model = make_model()
    tokens = torch.randint(1, CFG.vocab_size, (2, 50), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        masked = model(tokens, document_ids=document_ids(tokens, EOS))
        causal = model(tokens)
    assert (masked - causal).abs().max() <= 1e-5


def test_without_document_ids_attention_is_the_is_causal_kernel(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    make_model()(torch.randint(1, CFG.vocab_size, (1, 16)))
    assert len(calls) == CFG.n_layers
    assert all(c["is_causal"] and c["attn_mask"] is None for c in calls)


@quiet_flex
def test_flex_attention_matches_sdpa():
    # 300 positions: not a multiple of flex attention's 128-token blocks.
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 8, (2, 300), generator=gen)  # EOS (0) about every 8 tokens
    ids = document_ids(tokens, EOS)
    q = torch.randn(2, 4, 300, 16, generator=gen)
    k, v = torch.randn(2, 2, 2, 300, 16, generator=gen)
    # torch 2.13 has no flex attention backward on CPU: forward only here.
    with torch.no_grad():
        flex_mask = build_document_mask(ids, "flex")
        assert isinstance(flex_mask, BlockMask)
        flex = masked_attention(q, k, v, flex_mask)
        sdpa = masked_attention(q, k, v, build_document_mask(ids, "sdpa"))
    assert (flex - sdpa).abs().max() <= 1e-5


@quiet_flex
def test_model_on_flex_attention_matches_sdpa(monkeypatch):
    model = make_model()
    packed = torch.cat([document(70, seed=5), document(90, seed=6), document(40, seed=7)])[None]
    ids = document_ids(packed, EOS)
    with torch.no_grad():
        sdpa = model(packed, document_ids=ids)
        flex_masks = functools.partial(build_document_mask, kernel="flex")
        monkeypatch.setattr(mask_module, "build_document_mask", flex_masks)
        flex = model(packed, document_ids=ids)
    assert (flex - sdpa).abs().max() <= 1e-5


def test_document_ids_with_a_kv_cache_are_refused():
    model = make_model()
    cache = KVCache(
        n_layers=CFG.n_layers,
        batch=1,
        n_kv_heads=2,
        head_dim=16,
        max_len=8,
        device="cpu",
        dtype=torch.float32,
    )
    tokens = torch.randint(1, CFG.vocab_size, (1, 4))
    with pytest.raises(ValueError, match="KV cache"):
        model(tokens, cache, document_ids=document_ids(tokens, EOS))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_flex_on_cuda_matches_sdpa_forward_and_backward():
    torch.manual_seed(8)
    ids = document_ids(torch.randint(0, 50, (2, 1000), device="cuda"), EOS)
    mask = build_document_mask(ids)
    assert isinstance(mask, BlockMask)
    q, k, v = (torch.randn(2, h, 1000, 64, device="cuda", requires_grad=True) for h in (8, 2, 2))
    flex = masked_attention(q, k, v, mask)
    flex_grads = torch.autograd.grad(flex.square().sum(), (q, k, v))
    sdpa = masked_attention(q, k, v, build_document_mask(ids, "sdpa"))
    sdpa_grads = torch.autograd.grad(sdpa.square().sum(), (q, k, v))
    torch.testing.assert_close(flex, sdpa, atol=1e-4, rtol=1e-4)
    for a, b in zip(flex_grads, sdpa_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
