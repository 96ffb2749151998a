"""The Llama family: pre-norm decoder blocks of grouped-query attention (optionally with per-head
q/k RMSNorms and a head width of its own) and a SwiGLU or Mixture-of-Experts feed-forward, with
rotary positions. Covers Llama 3.x, Qwen3 dense, Mixtral and Qwen3-MoE: they differ by keys
(head_dim, qk_norm, tie_embeddings, the MoE settings). docs/models.md."""

from __future__ import annotations

from kiln.config.sections import ModelConfig
from kiln.model.family import ModelFamily
from kiln.model.forward_args import StageRole
from kiln.model.llama.counts import attention_terms, count_params, flops_per_token
from kiln.model.llama.hf_adapters import ADAPTERS, export_adapter


def _build(cfg: ModelConfig, stage: StageRole | None = None):
    # Imported here: the family is described without torch (kiln plan and kiln check).
    from kiln.model.llama.model import Transformer

    return Transformer(cfg, stage)


def _parallel_plan(cfg: ModelConfig):
    from kiln.model.llama.plan import llama_plan

    return llama_plan(cfg)


FAMILY = ModelFamily(
    name="llama",
    build=_build,
    parallel_plan=_parallel_plan,
    hf_adapters=ADAPTERS,
    export_adapter=export_adapter,
    count_params=count_params,
    flops_per_token=flops_per_token,
    attention_terms=attention_terms,
)
