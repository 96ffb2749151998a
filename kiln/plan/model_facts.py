"""Model counts the planner asks for thousands of times in one search, computed once per model.

A search evaluates every candidate layout of the same model; counting its parameters walks the
layers each time. The counts are kept by the model's field values (every ModelConfig field is a
scalar, but the [model.moe] table, whose values are taken in turn), so an edited config is counted
again.
"""

from __future__ import annotations

from kiln.config.sections import ModelConfig
from kiln.model import ParamCount, count_params, flops_per_token
from kiln.model.family import AttentionTerms
from kiln.model.registry import family_of

_PARAMS: dict[tuple, ParamCount] = {}
_MOE_LAYERS: dict[tuple, int] = {}
_FLOPS: dict[tuple, int] = {}
_LIMIT = 256


def _key(m: ModelConfig) -> tuple:
    return tuple(tuple(vars(v).values()) if k == "moe" else v for k, v in vars(m).items())


def _remember(cache: dict, key: tuple, value):
    if len(cache) >= _LIMIT:
        cache.clear()
    cache[key] = value
    return value


def params(m: ModelConfig) -> ParamCount:
    key = _key(m)
    found = _PARAMS.get(key)
    return found if found is not None else _remember(_PARAMS, key, count_params(m))


def moe_layers(m: ModelConfig) -> int:
    """Blocks with an MoE feed-forward."""
    key = _key(m)
    found = _MOE_LAYERS.get(key)
    if found is None:
        found = _remember(_MOE_LAYERS, key, sum(m.is_moe_layer(i) for i in range(m.n_layers)))
    return found


def flops(m: ModelConfig, seq_len: int) -> int:
    """The family's FLOPs per trained token (e.g. kiln/model/llama/counts.py)."""
    key = (*_key(m), seq_len)
    found = _FLOPS.get(key)
    return found if found is not None else _remember(_FLOPS, key, flops_per_token(m, seq_len))


def attention(m: ModelConfig) -> AttentionTerms:
    """The shape of one block's attention, as the family describes it."""
    return family_of(m).attention_terms(m)
