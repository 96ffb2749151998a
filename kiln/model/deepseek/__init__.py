"""The DeepSeek-V3 family: multi-head latent attention, DeepSeek's Mixture of Experts (sigmoid
routing in groups, shared experts, auxiliary-loss-free balancing) after dense first blocks, YaRN
rotary scaling and multi-token prediction. Covers DeepSeek-V3/R1/V3.1, Kimi K2, Moonlight and the
V2-Lite shape. docs/models.md."""

from __future__ import annotations

from kiln.config.sections import ModelConfig
from kiln.model.deepseek.counts import attention_terms, count_params, flops_per_token
from kiln.model.deepseek.hf_adapters import ADAPTERS, export_adapter
from kiln.model.family import ModelFamily
from kiln.model.forward_args import StageRole


def _build(cfg: ModelConfig, stage: StageRole | None = None):
    # Imported here: the family is described without torch (kiln plan and kiln check).
    from kiln.model.deepseek.model import Transformer

    return Transformer(cfg, stage)


def _parallel_plan(cfg: ModelConfig):
    from kiln.model.deepseek.plan import deepseek_plan

    return deepseek_plan(cfg)


FAMILY = ModelFamily(
    name="deepseek_v3",
    build=_build,
    parallel_plan=_parallel_plan,
    hf_adapters=ADAPTERS,
    export_adapter=export_adapter,
    count_params=count_params,
    flops_per_token=flops_per_token,
    attention_terms=attention_terms,
)
