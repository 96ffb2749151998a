"""The Hugging Face architecture the DeepSeek-V3 family converts, both directions:
`DeepseekV3ForCausalLM` (hf_deepseek.py: config.json <-> ModelConfig), and the tensor name maps.
Kimi K2's checkpoints (model_type "kimi_k2", the same architecture and tensor names) are read by
a second adapter of the same functions; every export is model_type "deepseek_v3", which
transformers builds natively.

Names. kiln's blocks are `layers.{i}` with `attention.{wq | wq_a, q_norm, wq_b}`, `wkv_a`,
`kv_norm`, `wkv_b`, `wo`, and `feed_forward.*` (the Llama family's dense and MoE names); Hugging
Face's are `model.layers.{i}.self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}`,
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj` and `mlp.*`. The router's
`expert_bias` buffer is `mlp.gate.e_score_correction_bias`: both steer which experts are chosen
and never how much they weigh, so it is read and written (unlike Mixtral's or Qwen3-MoE's).

Rotary rows. DeepSeek's checkpoints (and transformers with rope_interleave, its default) rotate
the rotary dimensions of each query head and of the shared rotary key in interleaved pairs
(0, 1), (2, 3), ...; kiln rotates pairs (j, j + rope/2) (half-split). The query projection's
rotary rows of each head (its last qk_rope_head_dim rows) and the last qk_rope_head_dim rows of
kv_a_proj_with_mqa are reordered 0, 2, 4, ..., 1, 3, 5, ... on import and back on export: the
rotated vectors, and so the attention scores, are then the same on both sides.

Experts. transformers 5 holds them fused (`mlp.experts.gate_up_proj` (E, 2·I, D),
`mlp.experts.down_proj`), save_pretrained and the released checkpoints one tensor per expert
(`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`); import reads either, export writes the
per-expert layout.

Multi-token prediction. transformers' model has no MTP modules; the released checkpoints store
depth k as layer num_hidden_layers + k - 1: `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, a
whole block (`self_attn.*`, `mlp.*`, the two layernorms), and copies of the embedding
(`embed_tokens`) and output head (`shared_head.head`). Import maps them when the checkpoint has
them (the copies are checked equal to the main ones, which kiln shares); a checkpoint without
them (transformers' save_pretrained writes none) leaves kiln's MTP modules at their
initialization. Export writes them as released, copies included; transformers loads such a
folder and leaves those layers out (it reports them as unexpected keys).
"""

from __future__ import annotations

import dataclasses

from kiln.config import ModelConfig
from kiln.errors import KilnError
from kiln.model.deepseek.hf_deepseek import (
    ARCHITECTURE,
    KIMI_K2_MODEL_TYPE,
    MODEL_TYPE,
    deepseek_config_from_hf,
    deepseek_export_problems,
    deepseek_hf_config,
)
from kiln.model.family import HfAdapter, HfPart, NameMap

_BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
_LOW_RANK_QUERY = {
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
}
_DENSE_FFN = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_SHARED_EXPERTS = {
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# The MTP module's own tensors (kiln suffix under mtp.depths.{k} -> HF suffix of its layer).
_MTP_NAMES = {
    "embed_norm.weight": "enorm.weight",
    "hidden_norm.weight": "hnorm.weight",
    "proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}


def half_split_rows(block: int, nope: int, rope: int, blocks: int) -> tuple[int, ...]:
    """For a projection of `blocks` row blocks of `block` rows, each `nope` rows then `rope`
    rotary rows: the HF row of each kiln row, the rotary rows reordered from interleaved pairs
    to kiln's half-split layout (0, 2, 4, ..., 1, 3, 5, ...)."""
    within = [*range(nope), *(nope + j for j in (*range(0, rope, 2), *range(1, rope, 2)))]
    return tuple(b * block + j for b in range(blocks) for j in within)


def _block_names(cfg: ModelConfig, layer: int, hf: str, fused: bool) -> NameMap:
    """One block's map: kiln names relative to the block, HF ones under `hf` (its layer)."""
    mla, heads = cfg.mla, cfg.n_heads
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    query_rows = half_split_rows(qk, mla.qk_nope_head_dim, mla.qk_rope_head_dim, heads)
    names = {**_BLOCK_NAMES, **(_LOW_RANK_QUERY if mla.q_lora_rank > 0 else {})}
    moe = cfg.is_moe_layer(layer)
    names.update(_SHARED_EXPERTS if moe else _DENSE_FFN)
    out: NameMap = {kiln: [HfPart(f"{hf}.{name}")] for kiln, name in names.items()}
    query = "attention.wq_b.weight" if mla.q_lora_rank > 0 else "attention.wq.weight"
    hf_query = "q_b_proj" if mla.q_lora_rank > 0 else "q_proj"
    out[query] = [HfPart(f"{hf}.self_attn.{hf_query}.weight", rows=query_rows)]
    latent_rows = half_split_rows(
        mla.kv_lora_rank + mla.qk_rope_head_dim, mla.kv_lora_rank, mla.qk_rope_head_dim, 1
    )
    out["attention.wkv_a.weight"] = [
        HfPart(f"{hf}.self_attn.kv_a_proj_with_mqa.weight", rows=latent_rows)
    ]
    if not moe:
        return out
    out["feed_forward.router.gate.weight"] = [HfPart(f"{hf}.mlp.gate.weight")]
    out["feed_forward.router.expert_bias"] = [HfPart(f"{hf}.mlp.gate.e_score_correction_bias")]
    if fused:
        out["feed_forward.experts.w1"] = [HfPart(f"{hf}.mlp.experts.gate_up_proj", half=0)]
        out["feed_forward.experts.w3"] = [HfPart(f"{hf}.mlp.experts.gate_up_proj", half=1)]
        out["feed_forward.experts.w2"] = [HfPart(f"{hf}.mlp.experts.down_proj")]
        return out
    for kiln_name, hf_name in _EXPERTS.items():
        out[f"feed_forward.experts.{kiln_name}"] = [
            HfPart(f"{hf}.mlp.experts.{e}.{hf_name}.weight", expert=e)
            for e in range(cfg.moe.num_experts)
        ]
    return out


def _names(cfg: ModelConfig, hf_names: set[str] | None) -> NameMap:
    """The whole model's map. `hf_names`: the checkpoint's tensors when importing (the expert
    layout and which MTP depths it holds are read from them), None when exporting."""

    def fused(hf: str) -> bool:
        return hf_names is not None and f"{hf}.mlp.experts.gate_up_proj" in hf_names

    def has(name: str) -> bool:
        return hf_names is None or name in hf_names

    embedding = [HfPart("model.embed_tokens.weight")]
    head = [HfPart("lm_head.weight")]
    names: NameMap = {"norm.weight": [HfPart("model.norm.weight")]}
    for i in range(cfg.n_layers):
        hf = f"model.layers.{i}"
        for name, parts in _block_names(cfg, i, hf, fused(hf)).items():
            names[f"layers.{i}.{name}"] = parts
    for k in range(1, cfg.mtp.depth + 1):
        layer = cfg.n_layers + k - 1
        hf, kiln = f"model.layers.{layer}", f"mtp.depths.{k}"
        if not has(f"{hf}.eh_proj.weight"):
            continue  # not in the checkpoint: kiln's initialization (hf_convert._init_unmapped)
        for name, hf_name in _MTP_NAMES.items():
            names[f"{kiln}.{name}"] = [HfPart(f"{hf}.{hf_name}")]
        for name, parts in _block_names(cfg, layer, hf, fused(hf)).items():
            names[f"{kiln}.block.{name}"] = parts
        # The released checkpoints repeat the shared embedding and head in each MTP layer.
        if has(f"{hf}.embed_tokens.weight"):
            embedding.append(HfPart(f"{hf}.embed_tokens.weight", copy=True))
        if has(f"{hf}.shared_head.head.weight"):
            head.append(HfPart(f"{hf}.shared_head.head.weight", copy=True))
    names["tok_embeddings.weight"] = embedding
    names["output.weight"] = head
    return names


def deepseek_import_names(cfg: ModelConfig, hf_names: set[str]) -> NameMap:
    """The name map for reading a checkpoint of either expert layout, with or without MTP."""
    return _names(cfg, hf_names)


def deepseek_export_names(cfg: ModelConfig) -> NameMap:
    """The name map for writing, in the released layout: per-expert tensors, MTP layers with
    their copies of the embedding and head."""
    return _names(cfg, None)


DEEPSEEK_V3 = HfAdapter(
    model_type=MODEL_TYPE,
    architecture=ARCHITECTURE,
    config_from_hf=deepseek_config_from_hf,
    hf_config=deepseek_hf_config,
    import_names=deepseek_import_names,
    export_names=deepseek_export_names,
    export_problems=deepseek_export_problems,
)
KIMI_K2 = dataclasses.replace(DEEPSEEK_V3, model_type=KIMI_K2_MODEL_TYPE)
ADAPTERS = (DEEPSEEK_V3, KIMI_K2)


def export_adapter(cfg: ModelConfig) -> HfAdapter:
    """DeepseekV3ForCausalLM, or KilnError saying what it would compute differently."""
    problems = DEEPSEEK_V3.export_problems(cfg)
    if problems:
        raise KilnError(
            f"cannot export this model as {ARCHITECTURE}: "
            + "; ".join(problems)
            + ". It would compute different outputs"
        )
    return DEEPSEEK_V3
