"""The Hugging Face architectures the Llama family converts, both directions, and which one a
kiln model exports as: by its keys, the architecture that computes the same thing."""

from __future__ import annotations

from functools import partial

from kiln.config import ModelConfig
from kiln.errors import KilnError
from kiln.model.family import HfAdapter
from kiln.model.llama.hf_gpt_oss import (
    gpt_oss_config_from_hf,
    gpt_oss_export_problems,
    gpt_oss_hf_config,
    gpt_oss_names,
)
from kiln.model.llama.hf_llama import (
    attention_export_problems,
    llama_config_from_hf,
    llama_hf_config,
)
from kiln.model.llama.hf_moe import (
    FAMILIES,
    check_expert_biases,
    export_family_problems,
    moe_config_from_hf,
    moe_export_names,
    moe_hf_config,
    moe_import_names,
)
from kiln.model.llama.hf_names import model_names
from kiln.model.llama.hf_qwen3 import qwen3_config_from_hf, qwen3_export_problems, qwen3_hf_config


def _llama_export_problems(cfg: ModelConfig) -> list[str]:
    problems = []
    if cfg.moe.num_experts > 0:
        problems.append(f"model.moe.num_experts = {cfg.moe.num_experts} (Llama is dense)")
    if cfg.qk_norm:
        problems.append("model.qk_norm = true (Llama's attention does not normalize q and k)")
    return problems + attention_export_problems(cfg, "Llama", window="none")


def _dense_names(cfg: ModelConfig, hf_names: set[str] | None = None) -> dict:
    return model_names(cfg)


LLAMA = HfAdapter(
    model_type="llama",
    architecture="LlamaForCausalLM",
    config_from_hf=llama_config_from_hf,
    hf_config=llama_hf_config,
    import_names=_dense_names,
    export_names=_dense_names,
    export_problems=_llama_export_problems,
)
QWEN3 = HfAdapter(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    config_from_hf=qwen3_config_from_hf,
    hf_config=qwen3_hf_config,
    import_names=_dense_names,
    export_names=_dense_names,
    export_problems=qwen3_export_problems,
)


def _moe_adapter(kind: str) -> HfAdapter:
    return HfAdapter(
        model_type=kind,
        architecture=FAMILIES[kind][0],
        config_from_hf=moe_config_from_hf,
        hf_config=partial(moe_hf_config, kind=kind),
        import_names=partial(moe_import_names, kind=kind),
        export_names=partial(moe_export_names, kind=kind),
        export_problems=partial(export_family_problems, kind=kind),
        check_export_model=partial(check_expert_biases, family=FAMILIES[kind][1]),
    )


MIXTRAL, QWEN3_MOE = _moe_adapter("mixtral"), _moe_adapter("qwen3_moe")
GPT_OSS = HfAdapter(
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    config_from_hf=gpt_oss_config_from_hf,
    hf_config=gpt_oss_hf_config,
    import_names=gpt_oss_names,
    export_names=gpt_oss_names,
    export_problems=gpt_oss_export_problems,
    check_export_model=partial(check_expert_biases, family="gpt-oss"),
)
ADAPTERS = (LLAMA, QWEN3, MIXTRAL, QWEN3_MOE, GPT_OSS)


def export_adapter(cfg: ModelConfig) -> HfAdapter:
    """The architecture with the same attention and feed-forward as `cfg`: sinks or clamped
    experts make it gpt-oss, q/k norms Qwen3 (dense) or Qwen3-MoE, else Llama or Mixtral. Raises
    KilnError when that one would compute something else, saying what."""
    moe = cfg.moe.num_experts > 0
    if cfg.attention_sinks or cfg.moe.activation == "clamped_swiglu":
        adapter, why = GPT_OSS, "the architecture of attention sinks and clamped SwiGLU experts"
    else:
        adapter = {(False, False): LLAMA, (False, True): QWEN3, (True, False): MIXTRAL}.get(
            (moe, cfg.qk_norm), QWEN3_MOE
        )
        qk_norm = str(cfg.qk_norm).lower()
        why = f"the architecture for model.qk_norm = {qk_norm}, {'MoE' if moe else 'dense'}"
    problems = adapter.export_problems(cfg)
    if problems:
        raise KilnError(
            f"cannot export this model as {adapter.architecture} ({why}): "
            + "; ".join(problems)
            + ". It would compute different outputs"
        )
    return adapter
