from kiln.model.flops import ParamCount, count_params, flops_per_token
from kiln.model.kv_cache import KVCache
from kiln.model.transformer import Transformer, build_model, materialize

__all__ = [
    "KVCache",
    "ParamCount",
    "Transformer",
    "build_model",
    "count_params",
    "flops_per_token",
    "materialize",
]
