"""The model package: the model families (kiln/model/registry.py) and what every family shares.
Counting parameters and FLOPs needs no torch, so `kiln plan` and `kiln check` answer without
importing it (seconds on a small machine); the modules are loaded on first use of their names."""

from __future__ import annotations

from importlib import import_module

from kiln.config.sections import ModelConfig
from kiln.model.family import ParamCount
from kiln.model.registry import family_of

_LAZY = {
    "KVCache": "kiln.model.kv_cache",
    "build_model": "kiln.model.build",
    "materialize": "kiln.model.build",
}

__all__ = ["ParamCount", "count_params", "flops_per_token", *_LAZY]


def count_params(cfg: ModelConfig) -> ParamCount:
    """Parameter counts of `cfg`'s model, by its family."""
    return family_of(cfg).count_params(cfg)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward FLOPs per trained token of `cfg`'s model at `seq_len`, by its family."""
    return family_of(cfg).flops_per_token(cfg, seq_len)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kiln.model' has no attribute {name!r}")
