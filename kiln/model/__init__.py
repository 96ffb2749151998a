"""The model package. Counting parameters and FLOPs needs no torch, so `kiln plan` and `kiln
check` answer without importing it (seconds on a small machine); the modules are loaded on first
use of their names."""

from importlib import import_module

from kiln.model.flops import ParamCount, count_params, flops_per_token

_LAZY = {
    "KVCache": "kiln.model.kv_cache",
    "Transformer": "kiln.model.transformer",
    "build_model": "kiln.model.transformer",
    "materialize": "kiln.model.transformer",
}

__all__ = ["ParamCount", "count_params", "flops_per_token", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kiln.model' has no attribute {name!r}")
