"""Sliding-window attention and attention sinks (model.sliding_window, model.layer_types,
model.attention_sinks): the masks and kernels against a plain masked softmax, the model's
layers, the FLOPs, and what validation refuses."""

from __future__ import annotations

import pytest
import torch

from kiln.config import load_config, validate
from kiln.config.sections import ModelConfig
from kiln.errors import ConfigError
from kiln.model import build_model, flops_per_token
from kiln.model.build import materialize
from kiln.model.counts import causal_attention_flops
from kiln.model.document_mask import (
    build_document_mask,
    build_position_mask,
    causal_mask,
    document_ids,
    masked_attention,
)
from tests.conftest import DEBUG_CONFIG

WINDOW = 5


def reference(q, k, v, *, ids, window, sinks):
    """The definition, written out in fp32: query i sees key j of its document when
    0 <= i - j < window; the sink of each head is one more logit in every softmax."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    seq = q.shape[2]
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    visible = (i - j >= 0) & (i - j < window) & (ids[:, :, None] == ids[:, None, :])[:, None]
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    columns = (
        [scores]
        if sinks is None
        else [scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)]
    )
    weights = torch.softmax(torch.cat(columns, dim=-1), dim=-1)[..., :seq]
    return weights @ v


def inputs(seed=0, batch=2, heads=4, kv_heads=2, seq=12, dim=8):
    torch.manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim)
    k, v = torch.randn(batch, kv_heads, seq, dim), torch.randn(batch, kv_heads, seq, dim)
    tokens = torch.randint(1, 6, (batch, seq))
    tokens[0, 4] = tokens[1, 7] = 0  # an EOS (id 0) in each row: two documents
    return q, k, v, document_ids(tokens, eos_id=0), torch.randn(heads)


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
@pytest.mark.parametrize("sinks", [False, True], ids=["no sinks", "sinks"])
def test_window_documents_and_sinks_equal_the_masked_softmax(kernel, sinks):
    """fp32: the dense path is the same softmax of the same products (exact up to the matmul's
    summation order, ~1e-7); flex (forward only on CPU) sums blockwise with an online softmax,
    ~1e-6 apart. A key outside the window or the document moves the output by ~1e-1."""
    q, k, v, ids, sink = inputs()
    sink = sink if sinks else None
    mask = build_document_mask(ids, kernel, window=WINDOW)
    got = masked_attention(q, k, v, mask, sinks=sink)
    torch.testing.assert_close(got, reference(q, k, v, ids=ids, window=WINDOW, sinks=sink),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_sink_and_query_gradients_equal_the_reference():
    """The dense path's backward (CPU training) against autograd through the definition."""
    q, k, v, ids, sink = inputs(seed=1)
    grads = []
    for fn in (
        lambda q, s: masked_attention(q, k, v, build_document_mask(ids, "sdpa", window=WINDOW), sinks=s),
        lambda q, s: reference(q, k, v, ids=ids, window=WINDOW, sinks=s),
    ):  # fmt: skip
        q_, s_ = q.clone().requires_grad_(), sink.clone().requires_grad_()
        fn(q_, s_).square().sum().backward()
        grads.append((q_.grad, s_.grad))
    for got, expected in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # fp32, as above


def test_a_window_by_positions_reaches_across_chunks_as_by_index():
    """Context parallel masks by global position over a rank's chunks (any order): the rows of
    chunks 0 and 3 of a sequence in 4 chunks see what the whole sequence's rows 0-2 and 9-11
    see, the window crossing the chunk boundary."""
    _, _, _, ids, _ = inputs()
    whole = build_document_mask(ids, "sdpa", window=WINDOW)
    rows = torch.tensor([0, 1, 2, 9, 10, 11])
    positions = rows.expand(2, -1)
    keys = torch.arange(12).expand(2, -1)
    chunked = build_position_mask(positions, keys, ids=ids[:, rows], key_ids=ids, kernel="sdpa",
                                  window=WINDOW)  # fmt: skip
    assert torch.equal(chunked, whole[:, :, rows])
    by_shape = causal_mask(3, 12, start=9, window=WINDOW, device=torch.device("cpu"))
    i = torch.arange(9, 12)[:, None]
    assert torch.equal(by_shape[0, 0], (i >= torch.arange(12)) & (i - torch.arange(12) < WINDOW))


def windowed(**overrides) -> ModelConfig:
    base = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64}
    return ModelConfig(**{**base, **overrides})


def test_only_the_sliding_layers_are_windowed_and_the_sinks_are_learned():
    """Layer 0 sliding, layer 1 full: a token beyond the window changes the logits through
    layer 1 only; with the window on both layers it cannot reach the last position's
    first-layer state. The sinks are parameters (one per head) that receive gradients."""
    cfg = windowed(sliding_window=3, layer_types=["sliding_attention", "full_attention"],
                   attention_sinks=True)  # fmt: skip
    model = materialize(build_model(cfg), device="cpu", seed=0)
    assert [model.layers[str(i)].attention.window for i in range(2)] == [3, 0]
    sinks = model.layers["0"].attention.sinks.weight
    assert sinks.shape == (4,)
    tokens = torch.randint(0, 64, (1, 10))
    model(tokens).sum().backward()
    assert sinks.grad is not None and sinks.grad.abs().sum() > 0
    first = model.layers["0"]
    h = model.tok_embeddings(tokens)
    cos, sin = model.rope_cos, model.rope_sin
    changed = tokens.clone()
    changed[0, 0] = (tokens[0, 0] + 1) % 64
    out = [first(model.tok_embeddings(t), cos, sin)[0, -1] for t in (tokens, changed)]
    assert torch.equal(out[0], out[1])  # position 0 is 9 tokens behind, outside a window of 3
    assert h.shape == (1, 10, 64)


def test_windowed_flops_count_the_keys_each_query_sees():
    """Per token, 6 FLOPs per multiply-add over the mean keys a query sees (2 matmuls, ×3 for
    the backward): counted here key by key."""
    seq, heads, width = 64, 4, 16
    for window in (0, 1, 7, 63, 64, 200):
        seen = sum(min(i + 1, window or seq) for i in range(seq))
        exact = 6 * seen * heads * 2 * width / seq
        # The causal term counts half the sequence (S/2, not (S+1)/2): within one key per query.
        assert abs(causal_attention_flops(seq, heads, width, width, window=window) - exact) <= (
            6 * heads * 2 * width
        )
    full, alternating = windowed(), windowed(sliding_window=8, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    assert flops_per_token(alternating, 256) < flops_per_token(full, 256)


BAD = {
    "a window longer than the context": (["--model.sliding_window=4096"], "longer than the model's context"),
    "layer types for another depth": (
        ["--model.sliding_window=8", "--model.layer_types=['sliding_attention']"],
        "lists 1 layers, model.n_layers is 2",
    ),
    "sliding layers without a window": (
        ["--model.layer_types=['sliding_attention', 'full_attention']"],
        "model.sliding_window is 0",
    ),
    "sinks in multi-head latent attention": (
        ["--model.family=deepseek_v3", "--model.attention_sinks=true"],
        "options of the llama family's attention",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_attention_options_are_refused_with_the_fix(case):
    overrides, fragment = BAD[case]
    with pytest.raises(ConfigError) as refused:
        validate(load_config(DEBUG_CONFIG, overrides), 1)
    assert fragment in str(refused.value)
