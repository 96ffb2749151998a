"""Mixture-of-Experts families of Hugging Face (Mixtral, Qwen3-MoE) <-> kiln MoE models.

Both route like kiln's "softmax_topk" router: a softmax over all experts in fp32, the top k of
those probabilities, and (Mixtral always, Qwen3-MoE with norm_topk_prob) the k weights divided
by their sum. Neither has shared experts, a routing bias, group-limited routing or a capacity
limit. Qwen3-MoE adds per-head q/k RMSNorms (kiln's qk_norm) and dense blocks where
decoder_sparse_step / mlp_only_layers say so. A kiln MoE model is exported as Qwen3-MoE when it
has qk_norm and as Mixtral when it has not: the family that has the same attention.

Checkpoint layouts (transformers 5.23). In memory the experts are fused 3-D parameters,
`mlp.experts.gate_up_proj` (E, 2·I, D: gate rows, then up rows) and `mlp.experts.down_proj`
(E, D, I), and the router is `mlp.gate.weight`. `save_pretrained` converts them back to one
tensor per expert, the layout of the published checkpoints, which transformers 4.x also reads:
Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2.weight` and `block_sparse_moe.gate.weight`,
Qwen3-MoE `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` and `mlp.gate.weight`. Import
reads either layout; export writes the per-expert one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.config import ModelConfig, MoEConfig
from kiln.errors import KilnError
from kiln.model.family import HfPart, NameMap
from kiln.model.llama.hf_llama import (
    REQUIRED_KEYS,
    attention_export_problems,
    base_fields,
    base_hf_config,
    base_problems,
    check_required,
    raise_problems,
    window_fields,
    window_hf_config,
)
from kiln.model.llama.hf_names import model_names

if TYPE_CHECKING:
    from torch import nn

# model_type -> (architecture, name in messages).
FAMILIES = {
    "mixtral": ("MixtralForCausalLM", "Mixtral"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3-MoE"),
}
# Defaults of each family's config class for keys a config.json may leave out.
_DEFAULTS = {
    "mixtral": {"rope_theta": 1e6, "norm_eps": 1e-5},
    "qwen3_moe": {"rope_theta": 10000.0, "norm_eps": 1e-6},
}
# kiln expert tensor -> per-expert HF tensor name of each family.
_EXPERT_NAMES = {
    "mixtral": {"w1": "w1", "w3": "w3", "w2": "w2"},
    "qwen3_moe": {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
}
# Where the per-expert layout keeps the router and experts (Mixtral's older module name).
_BLOCK = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp"}


def moe_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """kiln's ModelConfig for a Mixtral or Qwen3-MoE config.json, refusing what kiln's model
    would compute differently."""
    kind = hf["model_type"]
    architecture, family = FAMILIES[kind]
    architectures = hf.get("architectures") or [architecture]
    if architecture not in architectures:
        raise KilnError(
            f"unsupported model: model_type {kind!r} with architectures {architectures}; "
            f"only {architecture} checkpoints of model_type {kind!r} can be converted"
        )
    required = ("num_experts_per_tok", *(("moe_intermediate_size",) if kind == "qwen3_moe" else ()))
    check_required(hf, (*REQUIRED_KEYS, *required), family)
    if _num_experts(hf) is None:
        raise KilnError(f"config.json lacks num_local_experts; is it a complete {family} config?")
    layers, layer_problems = _qwen3_layers(hf) if kind == "qwen3_moe" else ({}, [])
    raise_problems(
        family,
        base_problems(hf) + layer_problems,
    )
    experts = _num_experts(hf)
    expert_dim = hf["moe_intermediate_size"] if kind == "qwen3_moe" else hf["intermediate_size"]
    return ModelConfig(
        **base_fields(hf, **_DEFAULTS[kind]),
        **window_fields(hf, sliding_flag=kind == "qwen3_moe", per_layer=False),
        ffn_hidden_dim=hf["intermediate_size"],
        qk_norm=kind == "qwen3_moe",
        moe=MoEConfig(
            num_experts=experts,
            top_k=hf["num_experts_per_tok"],
            ffn_hidden_dim=expert_dim,
            router="softmax_topk",
            route_norm=bool(hf.get("norm_topk_prob", False)) if kind == "qwen3_moe" else True,
            **layers,
        ),
    )


def _num_experts(hf: dict[str, Any]) -> int | None:
    # transformers 5 writes num_local_experts for both; Qwen3-MoE's own configs say num_experts.
    value = hf.get("num_local_experts", hf.get("num_experts"))
    return None if value is None else int(value)


def _qwen3_layers(hf: dict[str, Any]) -> tuple[dict[str, int], list[str]]:
    """moe.frequency and moe.first_dense_layers for Qwen3-MoE's choice of MoE blocks (block i
    is MoE when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0), or the
    problem when kiln's every-k-th-block rule cannot make the same choice."""
    n_layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense_only = sorted(hf.get("mlp_only_layers") or [])
    if not isinstance(step, int) or step < 1:
        return {}, [f"decoder_sparse_step = {step!r} (must be a positive integer)"]
    moe = [i for i in range(n_layers) if i not in dense_only and (i + 1) % step == 0]
    how = f"decoder_sparse_step = {step}, mlp_only_layers = {dense_only}"
    if not moe or _num_experts(hf) == 0:
        return {}, [f"no MoE block ({how}, {_num_experts(hf)} experts): a dense model"]
    first = moe[0]
    # One MoE block: any frequency that steps past the last block.
    fields = {
        "frequency": moe[1] - first if len(moe) > 1 else n_layers - first,
        "first_dense_layers": first,
    }
    kiln = ModelConfig(n_layers=n_layers, moe=MoEConfig(num_experts=1, **fields))
    if [i for i in range(n_layers) if kiln.is_moe_layer(i)] != moe:
        return {}, [
            f"MoE blocks {moe} ({how}): kiln makes every moe.frequency-th block MoE from "
            "moe.first_dense_layers on and cannot express this choice"
        ]
    return fields, []


def export_family_problems(cfg: ModelConfig, *, kind: str) -> list[str]:
    """Why a kiln model cannot be exported as `kind` (empty: it can)."""
    family = FAMILIES[kind][1]
    if cfg.moe.num_experts <= 0:
        return [f"model.moe.num_experts = {cfg.moe.num_experts} ({family} has routed experts)"]
    problems = _routing_problems(cfg, family)
    problems += attention_export_problems(cfg, family, window="every_layer")
    if kind == "mixtral":
        if not cfg.moe.route_norm:
            problems.append("model.moe.route_norm = false (Mixtral renormalizes the top-k weights)")
        if any(not cfg.is_moe_layer(i) for i in range(cfg.n_layers)):
            problems.append(
                f"dense blocks (moe.first_dense_layers = {cfg.moe.first_dense_layers}, "
                f"moe.frequency = {cfg.moe.frequency}; every Mixtral block is MoE)"
            )
    return problems


def _routing_problems(cfg: ModelConfig, family: str) -> list[str]:
    problems = []
    if cfg.moe.router != "softmax_topk":
        problems.append(f"model.moe.router = {cfg.moe.router!r} ({family} uses softmax_topk)")
    if cfg.moe.route_scale != 1.0:
        problems.append(f"model.moe.route_scale = {cfg.moe.route_scale} ({family} has no scale)")
    if cfg.moe.topk_groups < cfg.moe.n_groups:
        problems.append(
            f"group-limited routing (moe.n_groups = {cfg.moe.n_groups}, moe.topk_groups = "
            f"{cfg.moe.topk_groups})"
        )
    if cfg.moe.shared_experts:
        problems.append(f"model.moe.shared_experts = {cfg.moe.shared_experts} (no shared experts)")
    return problems


def check_expert_biases(model: nn.Module, *, family: str) -> None:
    """Refuse to export a model whose aux-loss-free balancing moved its routing biases: they
    decide which experts each token goes to, and the Hugging Face router has none."""
    moved = [
        name
        for name, buffer in model.named_buffers()
        if name.endswith("router.expert_bias") and bool(buffer.any())
    ]
    if moved:
        raise KilnError(
            f"{len(moved)} MoE block(s) have a non-zero router.expert_bias (first: {moved[0]}), "
            f"set by auxiliary-loss-free balancing (model.moe.bias_update_rate); {family}'s "
            "router has no such bias, so the exported model would send tokens to other experts "
            "than kiln does"
        )


def moe_hf_config(
    cfg: ModelConfig, dtype: str, special: dict[str, tuple[str, int]], *, kind: str
) -> dict[str, Any]:
    """A complete config.json of `kind` for a kiln MoE model it can express."""
    config = {
        "architectures": [FAMILIES[kind][0]],
        "model_type": kind,
        **base_hf_config(cfg, dtype, special),
        "num_experts_per_tok": cfg.moe.top_k,
        "output_router_logits": False,
        **window_hf_config(cfg),
    }
    if kind == "mixtral":
        config.update(
            intermediate_size=cfg.expert_hidden_dim,
            num_local_experts=cfg.moe.num_experts,
            router_jitter_noise=0.0,
        )
        return config
    return {
        **config,
        **_qwen3_layer_keys(cfg),
        "intermediate_size": cfg.ffn_hidden_dim,
        "moe_intermediate_size": cfg.expert_hidden_dim,
        # Qwen3-MoE's own spelling; transformers 5 maps it onto num_local_experts.
        "num_experts": cfg.moe.num_experts,
        "norm_topk_prob": cfg.moe.route_norm,
    }


def _qwen3_layer_keys(cfg: ModelConfig) -> dict[str, Any]:
    """decoder_sparse_step and mlp_only_layers that make the same blocks MoE as kiln: every
    moe.frequency-th block when kiln's pattern is aligned to it, else every block but a list."""
    moe = {i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)}
    for step in (cfg.moe.frequency, 1):
        candidates = {i for i in range(cfg.n_layers) if (i + 1) % step == 0}
        if moe <= candidates:
            return {"decoder_sparse_step": step, "mlp_only_layers": sorted(candidates - moe)}
    raise AssertionError("step 1 makes every block a candidate")


def moe_import_names(cfg: ModelConfig, hf_names: set[str], *, kind: str) -> NameMap:
    """The name map for reading a checkpoint: fused experts where it has them, else per expert."""
    fused = any(name.endswith(".experts.gate_up_proj") for name in hf_names)
    return model_names(cfg, lambda i: _fused_layer(i) if fused else _expert_layer(cfg, kind, i))


def moe_export_names(cfg: ModelConfig, *, kind: str) -> NameMap:
    """The name map for writing: one tensor per expert, as `save_pretrained` writes."""
    return model_names(cfg, lambda i: _expert_layer(cfg, kind, i))


def _expert_layer(cfg: ModelConfig, kind: str, i: int) -> NameMap:
    block = f"model.layers.{i}.{_BLOCK[kind]}"
    names: NameMap = {
        "feed_forward.router.gate.weight": [HfPart(f"{block}.gate.weight")],
        "feed_forward.router.expert_bias": [],
    }
    for kiln_name, hf_name in _EXPERT_NAMES[kind].items():
        names[f"feed_forward.experts.{kiln_name}"] = [
            HfPart(f"{block}.experts.{e}.{hf_name}.weight", expert=e)
            for e in range(cfg.moe.num_experts)
        ]
    return names


def _fused_layer(i: int) -> NameMap:
    block = f"model.layers.{i}.mlp"
    return {
        "feed_forward.router.gate.weight": [HfPart(f"{block}.gate.weight")],
        "feed_forward.router.expert_bias": [],
        "feed_forward.experts.w1": [HfPart(f"{block}.experts.gate_up_proj", half=0)],
        "feed_forward.experts.w3": [HfPart(f"{block}.experts.gate_up_proj", half=1)],
        "feed_forward.experts.w2": [HfPart(f"{block}.experts.down_proj")],
    }
