"""`model.family` -> the family that builds it, and a Hugging Face config.json -> the adapter
that converts it. The one module outside a family's folder that imports it (docs/models.md)."""

from __future__ import annotations

from typing import Any

from kiln.config.sections import MODEL_FAMILIES, ModelConfig
from kiln.errors import ConfigError, KilnError
from kiln.model.deepseek import FAMILY as DEEPSEEK_V3
from kiln.model.family import HfAdapter, ModelFamily
from kiln.model.llama import FAMILY as LLAMA
from kiln.model.qwen3_next import FAMILY as QWEN3_NEXT

FAMILIES: dict[str, ModelFamily] = {
    family.name: family for family in (LLAMA, DEEPSEEK_V3, QWEN3_NEXT)
}
assert tuple(FAMILIES) == MODEL_FAMILIES, "kiln/config/sections.py lists the families"

# config.json keys by which architectures announce routed experts.
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family `cfg.family` names."""
    if cfg.family not in FAMILIES:
        raise ConfigError(
            f"model.family = {cfg.family!r} is not one of {', '.join(map(repr, FAMILIES))}"
        )
    return FAMILIES[cfg.family]


def hf_adapters() -> list[tuple[ModelFamily, HfAdapter]]:
    """Every Hugging Face architecture kiln converts, with the family that builds it."""
    return [(family, adapter) for family in FAMILIES.values() for adapter in family.hf_adapters]


def supported_architectures() -> str:
    """The converted architectures, for messages."""
    return ", ".join(f"{a.architecture} ({a.model_type!r})" for _, a in hf_adapters())


def hf_adapter_for(hf: dict[str, Any]) -> tuple[ModelFamily, HfAdapter]:
    """The family and adapter that convert a Hugging Face config.json, found by its model_type
    and architectures; refused, naming those kiln converts, before anything is read."""
    kind, architectures = hf.get("model_type"), hf.get("architectures")
    for family, adapter in hf_adapters():
        if adapter.model_type == kind:
            if architectures and adapter.architecture not in architectures:
                raise KilnError(
                    f"unsupported model: model_type {kind!r} with architectures {architectures}; "
                    f"only {adapter.architecture} checkpoints of model_type {kind!r} can be "
                    "converted"
                )
            return family, adapter
    what = "Mixture-of-Experts model" if _looks_like_moe(hf) else "model"
    shown = f", architectures {architectures}" if architectures else ""
    raise KilnError(
        f"unsupported {what}: model_type {kind!r}{shown}; kiln converts {supported_architectures()}"
    )


def _looks_like_moe(hf: dict[str, Any]) -> bool:
    return "moe" in str(hf.get("model_type", "")) or any(hf.get(key) for key in _EXPERT_KEYS)


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """kiln's ModelConfig for a Hugging Face config.json, its family set."""
    family, adapter = hf_adapter_for(hf)
    cfg = adapter.config_from_hf(hf)
    cfg.family = family.name
    return cfg
