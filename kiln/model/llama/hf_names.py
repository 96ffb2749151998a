"""Which Hugging Face tensors hold which tensor of a Llama-family model: the name maps.

Most kiln tensors are one Hugging Face tensor under another name. Routed experts are not: kiln
stacks them into 3-D parameters (experts, out, in), while Hugging Face checkpoints hold one 2-D
tensor per expert, or fused 3-D tensors whose gate and up projections share one tensor. An
`HfPart` says where one piece of a kiln tensor lives, so one map serves loading and exporting.
"""

from __future__ import annotations

from collections.abc import Callable

from kiln.config import ModelConfig
from kiln.model.family import HfPart, NameMap

# Per-layer tensors every supported family shares (kiln suffix -> HF suffix). Rotary embeddings
# use the same half-split layout on both sides, so q/k weights need no permutation.
ATTENTION_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
QK_NORM_NAMES = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
DENSE_FFN_NAMES = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}


def model_names(cfg: ModelConfig, moe_layer: Callable[[int], NameMap] | None = None) -> NameMap:
    """The name map of a whole model. `moe_layer(i)` gives the feed-forward entries of an MoE
    block i (keys relative to `layers.{i}.`); dense blocks use the Llama MLP names."""
    names: NameMap = {
        "tok_embeddings.weight": [HfPart("model.embed_tokens.weight")],
        "norm.weight": [HfPart("model.norm.weight")],
    }
    if not cfg.tie_embeddings:
        names["output.weight"] = [HfPart("lm_head.weight")]
    for i in range(cfg.n_layers):
        layer = {**ATTENTION_NAMES, **(QK_NORM_NAMES if cfg.qk_norm else {})}
        moe = moe_layer is not None and cfg.is_moe_layer(i)
        if not moe:
            layer.update(DENSE_FFN_NAMES)
        for kiln_name, hf_name in layer.items():
            names[f"layers.{i}.{kiln_name}"] = [HfPart(f"model.layers.{i}.{hf_name}")]
        if moe:
            names.update({f"layers.{i}.{name}": parts for name, parts in moe_layer(i).items()})
    return names
