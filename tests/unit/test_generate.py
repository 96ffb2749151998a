"""Generation from a kiln model: seeded sampling and its filters, the end-of-sequence token and
the model's context."""

from __future__ import annotations

import pytest
import torch

from kiln.config import load_config
from kiln.errors import KilnError
from kiln.model import build_model, materialize
from kiln.model.generate import generate
from tests.conftest import DEBUG_CONFIG


def _model() -> torch.nn.Module:
    """The debug model with random weights: what it generates is tested, not what it knows."""
    model = materialize(build_model(load_config(DEBUG_CONFIG).model), device="cpu", seed=0)
    return model.eval()


def test_sampling_is_seeded_and_filters():
    model = _model()
    prompt = [1, 2, 3]
    greedy = generate(model, prompt, max_new_tokens=8)
    sample = dict(max_new_tokens=8, temperature=1.5, top_p=0.9, seed=4)
    assert generate(model, prompt, **sample) == generate(model, prompt, **sample)
    assert generate(model, prompt, **sample) != generate(model, prompt, **{**sample, "seed": 5})
    assert generate(model, prompt, max_new_tokens=8, temperature=2.0, top_k=1) == greedy
    assert generate(model, prompt, max_new_tokens=8, temperature=2.0, top_p=1e-6) == greedy


def test_generation_stops_at_eos_and_context():
    model = _model()
    greedy = generate(model, [1, 2, 3], max_new_tokens=8)
    assert (
        generate(model, [1, 2, 3], max_new_tokens=8, eos_id=greedy[2])
        == greedy[: greedy.index(greedy[2]) + 1]
    )
    long_prompt = [7] * (model.cfg.max_seq_len - 2)
    assert len(generate(model, long_prompt, max_new_tokens=10)) == 3
    with pytest.raises(KilnError, match="more than the model's context"):
        generate(model, [7] * (model.cfg.max_seq_len + 1), max_new_tokens=1)
