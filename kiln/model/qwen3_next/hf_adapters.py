"""The Hugging Face architectures the qwen3_next family converts, both directions, and which
one a kiln model exports as (hf_qwen3_next.py: config.json <-> ModelConfig).

Names. kiln's blocks are `layers.{i}` with `attention_norm`, `ffn_norm`, `attention.{wq, wk,
wv, wo, q_norm, k_norm}` or `linear_attention.{wq, wk, wv, wz, wb, wa, conv_q, conv_k, conv_v,
A_log, dt_bias, norm, wo}`, and `feed_forward.*` (a dense SwiGLU, or kiln's MoE block with a
gated shared expert); Hugging Face's are `model.layers.{i}` with `input_layernorm`,
`post_attention_layernorm`, `self_attn.*` or `linear_attn.*`, and `mlp.*`.

The Gated DeltaNet's projections. kiln keeps one matrix per role so that tensor parallel can
split each by heads; Hugging Face fuses them:
- Qwen3-Next's `in_proj_qkvz` holds, for each key head in turn, its query (key_head_dim rows),
  its key (key_head_dim), the values of the value heads it serves (group · value_head_dim, group
  = value heads per key head) and their output gates z (the same); `in_proj_ba` per key head
  its group's b (beta) rows, then their a (decay) rows;
- Qwen3.5's `in_proj_qkv` is all queries, then all keys, then all values; z, b and a have a
  matrix each (`in_proj_z`, `in_proj_b`, `in_proj_a`);
- both convolve [queries | keys | values] with one depthwise `conv1d.weight` (channels, 1,
  kernel): kiln's conv_q, conv_k and conv_v are its three row ranges, the size-1 dim dropped.
Each kiln tensor names its rows of the shared tensor (`HfPart.rows`); export writes them back.

Experts. transformers 5 holds them fused (`mlp.experts.gate_up_proj` (E, 2·I, D),
`mlp.experts.down_proj`), as Qwen3.5-MoE's releases store them; save_pretrained and Qwen3-Next's
releases store one tensor per expert. Import reads either layout, export writes per expert.

Left out. The releases also hold a multi-token prediction layer (`mtp.*`) and Qwen3.5's a vision
encoder (`model.visual.*`, the language model under `model.language_model.*`), which kiln does
not build: import leaves them out and says so. Export writes the text architecture alone.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from kiln.config.sections import ModelConfig
from kiln.errors import KilnError
from kiln.model.family import HfAdapter, HfPart, NameMap
from kiln.model.qwen3_next.hf_qwen3_next import (
    MULTIMODAL_TYPES,
    TEXT_TYPES,
    export_problems,
    qwen3_next_config_from_hf,
    qwen3_next_hf_config,
)

_LEFT_OUT = (("mtp.", "the multi-token prediction layer, which kiln does not build"),)
_VISION = (("model.visual.", "the vision encoder: kiln builds the language model"),)
_ATTENTION = {
    "attention.wq.weight": "q_proj.weight",
    "attention.wk.weight": "k_proj.weight",
    "attention.wv.weight": "v_proj.weight",
    "attention.wo.weight": "o_proj.weight",
    "attention.q_norm.weight": "q_norm.weight",
    "attention.k_norm.weight": "k_norm.weight",
}
_LINEAR_ATTENTION = {
    "A_log": "A_log",
    "dt_bias": "dt_bias",
    "norm.weight": "norm.weight",
    "wo.weight": "out_proj.weight",
}
_SWIGLU = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _rows(groups: int, block: int, offset: int, width: int) -> tuple[int, ...]:
    """Rows offset … offset + width − 1 of each of `groups` consecutive blocks of `block` rows."""
    return tuple(g * block + offset + j for g in range(groups) for j in range(width))


def _linear_attention(cfg: ModelConfig, hf: str, fused: bool) -> NameMap:
    """One Gated DeltaNet's map (kiln names under `linear_attention.`, HF ones under `hf`):
    Qwen3-Next's per-key-head fused projections (`fused`) or Qwen3.5's flat ones."""
    a = cfg.linear_attention
    heads, key, group = a.num_key_heads, a.key_head_dim, a.num_value_heads // a.num_key_heads
    value = group * a.value_head_dim  # the value rows of one key head's group
    keys, values = heads * key, heads * value
    names: NameMap = {k: [HfPart(f"{hf}.{v}")] for k, v in _LINEAR_ATTENTION.items()}
    if fused:
        qkvz, ba = f"{hf}.in_proj_qkvz.weight", f"{hf}.in_proj_ba.weight"
        block = 2 * key + 2 * value
        projections = {
            "wq": (qkvz, _rows(heads, block, 0, key)),
            "wk": (qkvz, _rows(heads, block, key, key)),
            "wv": (qkvz, _rows(heads, block, 2 * key, value)),
            "wz": (qkvz, _rows(heads, block, 2 * key + value, value)),
            "wb": (ba, _rows(heads, 2 * group, 0, group)),
            "wa": (ba, _rows(heads, 2 * group, group, group)),
        }
        for name, (tensor, rows) in projections.items():
            names[f"{name}.weight"] = [HfPart(tensor, rows=rows)]
    else:
        qkv = f"{hf}.in_proj_qkv.weight"
        names["wq.weight"] = [HfPart(qkv, rows=_rows(1, 0, 0, keys))]
        names["wk.weight"] = [HfPart(qkv, rows=_rows(1, 0, keys, keys))]
        names["wv.weight"] = [HfPart(qkv, rows=_rows(1, 0, 2 * keys, values))]
        for name in ("z", "b", "a"):
            names[f"w{name}.weight"] = [HfPart(f"{hf}.in_proj_{name}.weight")]
    conv = f"{hf}.conv1d.weight"
    for name, offset, width in (("q", 0, keys), ("k", keys, keys), ("v", 2 * keys, values)):
        names[f"conv_{name}"] = [HfPart(conv, rows=_rows(1, 0, offset, width), singleton=1)]
    return {f"linear_attention.{name}": parts for name, parts in names.items()}


def _feed_forward(cfg: ModelConfig, i: int, hf: str, fused: bool) -> NameMap:
    """One block's feed-forward (HF names under `hf`, its `mlp`): a dense SwiGLU, or the MoE
    block's router, experts (per expert, or fused where `fused`) and gated shared expert."""
    if not cfg.is_moe_layer(i):
        return {
            f"feed_forward.{k}.weight": [HfPart(f"{hf}.{v}.weight")] for k, v in _SWIGLU.items()
        }
    names: NameMap = {
        "feed_forward.router.gate.weight": [HfPart(f"{hf}.gate.weight")],
        "feed_forward.router.expert_bias": [],  # HF's router has none: it stays zero
        "feed_forward.shared_gate.weight": [HfPart(f"{hf}.shared_expert_gate.weight")],
    }
    for kiln, name in _SWIGLU.items():
        names[f"feed_forward.shared_experts.{kiln}.weight"] = [
            HfPart(f"{hf}.shared_expert.{name}.weight")
        ]
    if fused:
        names["feed_forward.experts.w1"] = [HfPart(f"{hf}.experts.gate_up_proj", half=0)]
        names["feed_forward.experts.w3"] = [HfPart(f"{hf}.experts.gate_up_proj", half=1)]
        names["feed_forward.experts.w2"] = [HfPart(f"{hf}.experts.down_proj")]
        return names
    for kiln, name in _SWIGLU.items():
        names[f"feed_forward.experts.{kiln}"] = [
            HfPart(f"{hf}.experts.{e}.{name}.weight", expert=e) for e in range(cfg.moe.num_experts)
        ]
    return names


def _names(cfg: ModelConfig, hf_names: set[str] | None, *, kind: str, prefix: str) -> NameMap:
    """The whole model's map, HF names of the language model under `prefix`. `hf_names`: the
    checkpoint's tensors when importing (which expert layout), None when exporting."""
    names: NameMap = {
        "tok_embeddings.weight": [HfPart(f"{prefix}embed_tokens.weight")],
        "norm.weight": [HfPart(f"{prefix}norm.weight")],
    }
    if not cfg.tie_embeddings:
        names["output.weight"] = [HfPart("lm_head.weight")]
    for i in range(cfg.n_layers):
        hf = f"{prefix}layers.{i}"
        block: NameMap = {
            "attention_norm.weight": [HfPart(f"{hf}.input_layernorm.weight")],
            "ffn_norm.weight": [HfPart(f"{hf}.post_attention_layernorm.weight")],
        }
        if cfg.is_linear_attention_layer(i):
            block |= _linear_attention(cfg, f"{hf}.linear_attn", fused=kind == "qwen3_next")
        else:
            block |= {k: [HfPart(f"{hf}.self_attn.{v}")] for k, v in _ATTENTION.items()}
        fused = hf_names is not None and f"{hf}.mlp.experts.gate_up_proj" in hf_names
        block |= _feed_forward(cfg, i, f"{hf}.mlp", fused)
        names |= {f"layers.{i}.{name}": parts for name, parts in block.items()}
    return names


def _check_expert_biases(model) -> None:
    """Refuse a model whose auxiliary-loss-free balancing moved its routing biases: they choose
    each token's experts, and the Hugging Face router has none."""
    moved = [
        name
        for name, buffer in model.named_buffers()
        if name.endswith("router.expert_bias") and bool(buffer.any())
    ]
    if moved:
        raise KilnError(
            f"{len(moved)} MoE block(s) have a non-zero router.expert_bias (first: {moved[0]}), "
            "set by auxiliary-loss-free balancing (model.moe.bias_update_rate); the Hugging "
            "Face router has no such bias, so the export would send tokens to other experts"
        )


def _text_adapter(kind: str) -> HfAdapter:
    names = partial(_names, kind=kind, prefix="model.")
    return HfAdapter(
        model_type=kind,
        architecture=TEXT_TYPES[kind][0],
        config_from_hf=qwen3_next_config_from_hf,
        hf_config=partial(qwen3_next_hf_config, kind=kind),
        import_names=names,
        export_names=lambda cfg: names(cfg, None),
        export_problems=partial(export_problems, kind=kind),
        check_export_model=_check_expert_biases,
        left_out=_LEFT_OUT,
    )


QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE = map(_text_adapter, TEXT_TYPES)


def _multimodal_adapter(kind: str, text: HfAdapter) -> HfAdapter:
    """A vision-language release read as its language model; it exports as `text`."""
    return dataclasses.replace(
        text,
        model_type=kind,
        architecture=MULTIMODAL_TYPES[kind][0],
        import_names=partial(_names, kind=text.model_type, prefix="model.language_model."),
        left_out=_LEFT_OUT + _VISION,
    )


ADAPTERS = (
    QWEN3_NEXT,
    QWEN3_5,
    QWEN3_5_MOE,
    _multimodal_adapter("qwen3_5", QWEN3_5),
    _multimodal_adapter("qwen3_5_moe", QWEN3_5_MOE),
)


def export_adapter(cfg: ModelConfig) -> HfAdapter:
    """Qwen3_5ForCausalLM for a dense model (Qwen3.5's text model is the family's dense
    release), Qwen3NextForCausalLM for one with experts (it holds every MoE layout kiln's keys
    state here: dense blocks between MoE ones, top-k weights left as they are; on the layouts
    both hold, Qwen3.5-MoE computes the same). KilnError saying what else it would compute."""
    adapter = QWEN3_NEXT if cfg.moe.num_experts > 0 else QWEN3_5
    problems = adapter.export_problems(cfg)
    if problems:
        raise KilnError(
            f"cannot export this model as {adapter.architecture}: "
            + "; ".join(problems)
            + ". It would compute different outputs"
        )
    return adapter
