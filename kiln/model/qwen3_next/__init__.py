"""The qwen3_next family: hybrid decoders of Gated DeltaNet (linear attention with a gated delta
rule state) and gated full attention layers, by model.layer_types, with a dense SwiGLU or
kiln's Mixture of Experts (a sigmoid-gated shared expert); zero-centred RMSNorms and partial
rotary positions. Covers Qwen3-Next and the Qwen3.5 text models. docs/models.md."""

from __future__ import annotations

from kiln.config.sections import ModelConfig
from kiln.model.family import ModelFamily
from kiln.model.forward_args import StageRole
from kiln.model.qwen3_next.counts import (
    attention_terms,
    count_params,
    flops_per_token,
    linear_mixer_terms,
)
from kiln.model.qwen3_next.hf_adapters import ADAPTERS, export_adapter


def _build(cfg: ModelConfig, stage: StageRole | None = None):
    # Imported here: the family is described without torch (kiln plan and kiln check).
    from kiln.model.qwen3_next.model import Transformer

    return Transformer(cfg, stage)


def _kernels(cfg: ModelConfig, device) -> str:
    from kiln.model.qwen3_next.delta_rule import kernel_name
    from kiln.model.qwen3_next.short_conv import conv_backend_name

    linear = sum(map(cfg.is_linear_attention_layer, range(cfg.n_layers)))
    kernel = kernel_name(cfg.linear_attention.kernel, device)
    conv = conv_backend_name() if kernel == "fla" else "torch"
    return (
        f"{linear} Gated DeltaNet layers (gated delta rule: {kernel} kernel, short "
        f"convolution: {conv}), {cfg.n_layers - linear} full attention"
    )


def _parallel_plan(cfg: ModelConfig):
    from kiln.model.qwen3_next.plan import qwen3_next_plan

    return qwen3_next_plan(cfg)


FAMILY = ModelFamily(
    name="qwen3_next",
    build=_build,
    parallel_plan=_parallel_plan,
    hf_adapters=ADAPTERS,
    export_adapter=export_adapter,
    count_params=count_params,
    flops_per_token=flops_per_token,
    attention_terms=attention_terms,
    kernels=_kernels,
    linear_mixer_terms=linear_mixer_terms,
)
