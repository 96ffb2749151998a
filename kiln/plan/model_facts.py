"""Model counts the planner asks for thousands of times in one search, computed once per model.

A search evaluates every candidate layout of the same model; counting its parameters walks the
layers each time. The counts are kept by the model's field values (every ModelConfig field is a
scalar, but the [model.moe], [model.mla] and [model.mtp] tables, whose values are taken in
turn), so an edited config is counted again.

Multi-token prediction (`model.mtp.depth`, family deepseek_v3) adds a block per depth after the
model's last, numbered n_layers + k - 1 for depth k: the last pipeline stage runs them, with one
more pass through the output head each. The family's plan names them as extra blocks: activation
checkpointing wraps them by the blocks' rule and FSDP shards each as a unit of its own.
"""

from __future__ import annotations

import math

from kiln.config.sections import ModelConfig
from kiln.model import ParamCount, count_params, flops_per_token
from kiln.model.family import AttentionTerms, LinearMixerTerms
from kiln.model.registry import family_of

_PARAMS: dict[tuple, ParamCount] = {}
_MOE_LAYERS: dict[tuple, int] = {}
_FLOPS: dict[tuple, int] = {}
_ATTENTION: dict[tuple, AttentionTerms] = {}
_LINEAR_MIXER: dict[tuple, LinearMixerTerms | None] = {}
_LIMIT = 256


def _key(m: ModelConfig) -> tuple:
    return tuple(_hashable(v) for k, v in vars(m).items())


def _hashable(value):
    if isinstance(value, list):  # model.layer_types
        return tuple(value)
    return tuple(vars(value).values()) if hasattr(value, "__dataclass_fields__") else value


def _remember(cache: dict, key: tuple, value):
    if len(cache) >= _LIMIT:
        cache.clear()
    cache[key] = value
    return value


def params(m: ModelConfig) -> ParamCount:
    key = _key(m)
    found = _PARAMS.get(key)
    return found if found is not None else _remember(_PARAMS, key, count_params(m))


def mtp_depth(m: ModelConfig) -> int:
    """Multi-token prediction modules, one block each, that training runs on the last stage."""
    return max(m.mtp.depth, 0)


def blocks(m: ModelConfig) -> int:
    """Transformer blocks a token goes through in training: the model's and MTP's."""
    return m.n_layers + mtp_depth(m)


def stage_layers(m: ModelConfig, pp: int) -> int:
    """The model's blocks on the busiest pipeline stage (at most the ceiling of an even split)."""
    return math.ceil(m.n_layers / pp)


def stage_blocks(m: ModelConfig, pp: int) -> int:
    """Blocks the busiest pipeline stage runs: the last, with its share of the model's blocks
    and the MTP modules' blocks."""
    return stage_layers(m, pp) + mtp_depth(m)


def mtp_layers(m: ModelConfig) -> range:
    """The layer indices of the MTP blocks: after the model's."""
    return range(m.n_layers, m.n_layers + mtp_depth(m))


def mtp_moe_blocks(m: ModelConfig) -> int:
    """MTP blocks with an MoE feed-forward."""
    return sum(m.is_moe_layer(layer) for layer in mtp_layers(m))


def moe_layers(m: ModelConfig) -> int:
    """Blocks with an MoE feed-forward, MTP's included."""
    key = _key(m)
    found = _MOE_LAYERS.get(key)
    if found is None:
        found = _remember(_MOE_LAYERS, key, sum(m.is_moe_layer(i) for i in range(blocks(m))))
    return found


def flops(m: ModelConfig, seq_len: int) -> int:
    """The family's FLOPs per trained token (e.g. kiln/model/llama/counts.py)."""
    key = (*_key(m), seq_len)
    found = _FLOPS.get(key)
    return found if found is not None else _remember(_FLOPS, key, flops_per_token(m, seq_len))


def attention(m: ModelConfig) -> AttentionTerms:
    """The shape of one block's attention, as the family describes it."""
    key = _key(m)
    found = _ATTENTION.get(key)
    return (
        found if found is not None else _remember(_ATTENTION, key, family_of(m).attention_terms(m))
    )


def linear_mixer(m: ModelConfig) -> LinearMixerTerms | None:
    """The blocks whose token mixer is not attention, as the family describes them (None: none)."""
    key = _key(m)
    if key not in _LINEAR_MIXER:
        terms = family_of(m).linear_mixer_terms
        _remember(_LINEAR_MIXER, key, terms(m) if terms is not None else None)
    return _LINEAR_MIXER[key]


def linear_mixer_layers(m: ModelConfig) -> int:
    """How many of the model's blocks have a linear mixer instead of attention."""
    terms = linear_mixer(m)
    return terms.layers if terms is not None else 0


def attention_flops(m: ModelConfig, seq_len: int) -> int:
    """Forward + backward FLOPs per trained token of causal attention (scores and weighted
    values) over all blocks: what the family's count adds to its 6 per matmul weight."""
    return flops(m, seq_len) - 6 * params(m).matmul
