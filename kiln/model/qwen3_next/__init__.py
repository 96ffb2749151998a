"""The qwen3_next family: hybrid decoders of Gated DeltaNet (linear attention with a gated delta
rule state) and gated full attention layers, by model.layer_types, with a dense SwiGLU or
kiln's Mixture of Experts (a sigmoid-gated shared expert); zero-centred RMSNorms and partial
rotary positions. Covers Qwen3-Next and the Qwen3.5 text models. docs/models.md."""

from __future__ import annotations

from kiln.config.sections import ModelConfig
from kiln.errors import KilnError
from kiln.model.family import HfAdapter, ModelFamily
from kiln.model.forward_args import StageRole
from kiln.model.qwen3_next.counts import attention_terms, count_params, flops_per_token


def _build(cfg: ModelConfig, stage: StageRole | None = None):
    # Imported here: the family is described without torch (kiln plan and kiln check).
    from kiln.model.qwen3_next.model import Transformer

    return Transformer(cfg, stage)


def _parallel_plan(cfg: ModelConfig):
    from kiln.model.qwen3_next.plan import qwen3_next_plan

    return qwen3_next_plan(cfg)


def _export_adapter(cfg: ModelConfig) -> HfAdapter:
    raise KilnError(
        "model.family 'qwen3_next' has no Hugging Face export yet (Qwen3-Next and Qwen3.5 "
        "conversion is not built); keep the kiln checkpoint"
    )


FAMILY = ModelFamily(
    name="qwen3_next",
    build=_build,
    parallel_plan=_parallel_plan,
    hf_adapters=(),
    export_adapter=_export_adapter,
    count_params=count_params,
    flops_per_token=flops_per_token,
    attention_terms=attention_terms,
)
