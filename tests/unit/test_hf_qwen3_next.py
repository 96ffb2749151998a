"""Hugging Face parity of the qwen3_next family (docs/models.md): tiny random Qwen3-Next, Qwen3.5
and Qwen3.5-MoE models in their releases' shape (value heads twice the key heads, a head width
other than hidden / heads, partial rotary positions, untied embeddings) convert to kiln with
transformers' fp32 logits and greedy tokens, and export back bit for bit to folders transformers
loads with the same logits; the vision-language releases convert as their language model; the
presets' export configs build transformers models of kiln's parameter counts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.checkpoint import read_model_config
from kiln.checkpoint.hf_convert import hf_to_kiln, kiln_to_hf
from kiln.checkpoint.hf_tensors import export_tensors
from kiln.cli import main
from kiln.config import load_config
from kiln.errors import KilnError
from kiln.model import count_params
from kiln.model.generate import generate
from kiln.model.registry import family_of, hf_adapter_for
from tests.unit.test_hf_convert import (
    TOLERANCE,
    VOCAB,
    _hf_greedy,
    _load_kiln,
    _max_diff,
    _randomize_norms,
    _tokens,
)

transformers = pytest.importorskip("transformers")

# Qwen3-Next's shape shrunk: 2 key heads of 16 serving 4 value heads of 8 in the Gated DeltaNet
# layers; 4 attention heads of 24 on hidden 64 (queries 96 wide, 6 rotary dims: a quarter); three
# linear layers then one full, as released.
COMMON = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    intermediate_size=96,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    # Larger than the 0.02 default: attention far from uniform and router probabilities far
    # apart, so a wrong row split, norm or routing rule moves the logits well past TOLERANCE.
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
# A shared expert two experts wide (kiln: moe.shared_experts = 2).
MOE = dict(
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
)
# variant -> (HF class, config class, config keys beyond COMMON).
VARIANTS = {
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", {**MOE, "norm_topk_prob": True}),
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5Config", {}),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeConfig", MOE),
}
EACH_VARIANT = pytest.mark.parametrize("variant", list(VARIANTS))


def _hf_model(variant: str, vision: bool = False) -> transformers.PreTrainedModel:
    """The variant's random model: its text model, or (`vision`) the vision-language release
    around it (a one-block vision encoder)."""
    class_name, config_class, keys = VARIANTS[variant]
    config_class = getattr(transformers, config_class)
    if vision:
        tower = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4)
        tower |= dict(out_hidden_size=64, num_position_embeddings=16)
        # Tied as Qwen3.5's small releases are, by the top level's key (the text_config's says
        # untied: the ForConditionalGeneration model ties by the top level's).
        tied = variant == "qwen3_5"
        config = config_class(
            text_config={**COMMON, **keys}, vision_config=tower, tie_word_embeddings=tied
        )
        class_name = class_name.replace("ForCausalLM", "ForConditionalGeneration")
    else:
        text_class = config_class.sub_configs.get("text_config", config_class)
        config = text_class(**COMMON, **keys)
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config).eval()
    model.config._attn_implementation = "eager"
    _randomize_norms(model)
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, transformers.PreTrainedModel, Path]]:
    """Per variant: the folder save_pretrained wrote, the HF model, and the kiln checkpoint."""
    out = {}
    for variant in VARIANTS:
        root = tmp_path_factory.mktemp(variant)
        model = _hf_model(variant)
        model.save_pretrained(root / "hf")
        out[variant] = (root / "hf", model, hf_to_kiln(root / "hf", root / "kiln"))
    return out


@EACH_VARIANT
def test_hf_to_kiln_maps_the_shape(converted, variant):
    cfg = read_model_config(converted[variant][2])
    assert cfg.family == "qwen3_next"
    assert (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rotary_dim) == (64, 4, 2, 24, 6)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.qk_norm and cfg.attention_output_gate and cfg.norm_zero_centered
    assert not cfg.tie_embeddings
    a = cfg.linear_attention
    assert (a.num_key_heads, a.num_value_heads, a.key_head_dim, a.value_head_dim) == (2, 4, 16, 8)
    if variant == "qwen3_5":
        assert (cfg.moe.num_experts, cfg.ffn_hidden_dim) == (0, 96)
    else:
        moe = cfg.moe
        assert (moe.num_experts, moe.top_k, moe.ffn_hidden_dim, moe.shared_experts) == (4, 2, 32, 2)
        assert moe.shared_expert_gate and moe.route_norm and moe.router == "softmax_topk"
        assert all(cfg.is_moe_layer(i) for i in range(cfg.n_layers))


@EACH_VARIANT
def test_hf_to_kiln_logits_and_tokens_match(converted, variant):
    _, hf_model, ckpt = converted[variant]
    model, tokens = _load_kiln(ckpt), _tokens()
    with torch.no_grad():
        diff = _max_diff(model(tokens), hf_model(tokens).logits)
    # TOLERANCE (1e-4, fp32): the same math in another order (kiln's chunked delta rule and SDPA
    # against transformers' torch fallbacks and eager attention) differs by fp32 rounding, up to
    # about 3e-5 on logits up to 7 here; a wrong row split, convolution or norm is off by far more.
    assert diff <= TOLERANCE, diff

    # kiln's generation carries the recurrent and convolution states, transformers' its cache.
    prompt = [5, 17, 42, 99, 250]
    assert generate(model, prompt, max_new_tokens=10) == _hf_greedy(hf_model, prompt, 10)


@EACH_VARIANT
def test_kiln_to_hf_writes_the_tensors_back_and_transformers_loads_them(
    converted, variant, tmp_path
):
    hf_dir, hf_model, ckpt = converted[variant]
    out = kiln_to_hf(ckpt, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    # Dense: Qwen3.5's text model; experts: Qwen3-Next, which computes Qwen3.5-MoE's function.
    architecture = "Qwen3_5ForCausalLM" if variant == "qwen3_5" else "Qwen3NextForCausalLM"
    assert config["architectures"] == [architecture]

    original, exported = (
        load_file(hf_dir / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    if variant == "qwen3_5_moe":
        # Its own adapter's names write save_pretrained's tensors back: the fused projections
        # joined from kiln's rows, the convolution's size-1 dim restored.
        _, adapter = hf_adapter_for({"model_type": "qwen3_5_moe_text"})
        model = _load_kiln(ckpt)
        exported = export_tensors(model, adapter.export_names(model.cfg))
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name

    loaded = getattr(transformers, architecture).from_pretrained(out, attn_implementation="eager")
    tokens = _tokens()
    with torch.no_grad():
        diff = _max_diff(loaded.eval()(tokens).logits, hf_model(tokens).logits)
    # The same weights (Qwen3.5-MoE's under Qwen3-Next's code: the same math): in practice equal.
    assert diff <= TOLERANCE, diff


def _fuse_experts(tensors: dict[str, torch.Tensor], experts: int) -> dict[str, torch.Tensor]:
    """The per-expert tensors of save_pretrained stacked into transformers 5's fused layout,
    as Qwen3.5-MoE's releases store them: gate_up_proj (E, 2·I, D), down_proj (E, D, I)."""
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    blocks = {k.split(".experts.")[0] for k in tensors if ".experts." in k}
    for block in blocks:
        gate, up, down = (
            torch.stack([tensors[f"{block}.experts.{e}.{name}.weight"] for e in range(experts)])
            for name in ("gate_proj", "up_proj", "down_proj")
        )
        out[f"{block}.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{block}.experts.down_proj"] = down
    return out


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5_moe"])
def test_vision_language_releases_convert_their_language_model(variant, tmp_path, capsys):
    """Qwen3.5 is released as Qwen3_5(Moe)ForConditionalGeneration: the language model under
    model.language_model, a vision encoder and a multi-token prediction layer beside it."""
    hf_model = _hf_model(variant, vision=True)
    hf_model.save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(weights)
    if variant == "qwen3_5_moe":
        tensors = _fuse_experts(tensors, MOE["num_experts"])
    save_file({**tensors, "mtp.fc.weight": torch.ones(64, 128)}, weights)
    assert main(["convert", "hf-to-kiln", str(tmp_path / "hf"), str(tmp_path / "kiln")]) == 0
    err = capsys.readouterr().err
    assert "tensors of" in err and "under mtp.* (the multi-token prediction layer" in err
    assert "under model.visual.* (the vision encoder: kiln builds the language model)" in err

    model = _load_kiln(tmp_path / "kiln")
    assert model.cfg.tie_embeddings is (variant == "qwen3_5")
    tokens = _tokens()
    with torch.no_grad():
        diff = _max_diff(model(tokens), hf_model(tokens).logits)
    assert diff <= TOLERANCE, diff  # fp32 rounding, as above; text positions: plain RoPE


def _write_config(tmp_path: Path, config: dict) -> Path:
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir(parents=True)
    (hf_dir / "config.json").write_text(json.dumps(config))
    return hf_dir


YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "partial_rotary_factor": 0.25}


@pytest.mark.parametrize(
    ("variant", "change", "message"),
    [
        ("qwen3_next", {"attention_bias": True}, "attention_bias = true"),
        ("qwen3_5", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("qwen3_5_moe", {"rope_parameters": YARN}, "RoPE scaling 'yarn'"),
        # transformers 4.x's spelling of the same.
        ("qwen3_next", {"rope_parameters": None, "rope_scaling": YARN}, "RoPE scaling 'yarn'"),
        (
            "qwen3_5",
            {"layer_types": ["linear_attention", "sliding_attention"] * 2},
            r"layer_types \['sliding_attention'\] \(kiln knows",
        ),
        ("qwen3_5", {"layer_types": ["full_attention"]}, "layer_types lists 1 layers"),
        ("qwen3_next", {"linear_num_value_heads": 3}, "linear_num_value_heads = 3 is not a"),
        ("qwen3_next", {"mlp_only_layers": [1]}, r"MoE blocks \[0, 2, 3\]"),
        ("qwen3_5_moe", {"shared_expert_intermediate_size": 48}, "not a positive multiple"),
        ("qwen3_5", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)
def test_unsupported_configs_are_refused(converted, tmp_path, variant, change, message):
    config = json.loads((converted[variant][0] / "config.json").read_text())
    # config.json alone, no weights: refused before they are read, and before out is made.
    hf_dir = _write_config(tmp_path, {**config, **change})
    name = {"qwen3_next": "Qwen3-Next", "qwen3_5": "Qwen3.5", "qwen3_5_moe": "Qwen3.5-MoE"}
    with pytest.raises(
        KilnError, match=f"cannot convert this {name[variant]} variant: .*{message}"
    ):
        hf_to_kiln(hf_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_configs_that_disagree_with_the_weights_are_refused(converted, tmp_path):
    hf_dir, _, _ = converted["qwen3_next"]
    config = json.loads((hf_dir / "config.json").read_text())
    # Narrower key heads: every kiln tensor of in_proj_qkvz would still find its rows in it.
    src = _write_config(tmp_path, {**config, "linear_key_head_dim": 8})
    shutil.copy(hf_dir / "model.safetensors", src)
    with pytest.raises(KilnError, match=r"in_proj_qkvz\.weight in .* has 128 rows, but config"):
        hf_to_kiln(src, tmp_path / "out")
    # A vision-language config without its language model's keys.
    multimodal = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"]}
    with pytest.raises(KilnError, match="lacks a text_config of model_type 'qwen3_5_text'"):
        hf_to_kiln(_write_config(tmp_path / "mm", multimodal), tmp_path / "out")


@pytest.mark.parametrize(
    ("variant", "table", "key", "value", "message"),
    [
        ("qwen3_next", "moe", "route_scale", 2.0, "model.moe.route_scale = 2.0"),
        ("qwen3_next", "moe", "shared_expert_gate", False, "has one gated shared expert"),
        ("qwen3_5", "", "attention_output_gate", False, "full attention gates its output"),
    ],
)
def test_models_the_architectures_cannot_hold_are_not_exported(
    converted, variant, table, key, value, message
):
    cfg = read_model_config(converted[variant][2])
    setattr(getattr(cfg, table) if table else cfg, key, value)
    with pytest.raises(KilnError, match=f"cannot export this model as .*{message}"):
        family_of(cfg).export_adapter(cfg)


def test_moved_routing_biases_are_not_exported(converted):
    model = _load_kiln(converted["qwen3_next"][2])
    model.layers["0"].feed_forward.router.expert_bias.fill_(0.5)
    with pytest.raises(KilnError, match=r"non-zero router\.expert_bias"):
        family_of(model.cfg).export_adapter(model.cfg).check_export_model(model)


@pytest.mark.parametrize("preset", ["qwen3_next_80b_a3b", "qwen3_5_9b"])
def test_presets_export_configs_transformers_builds_with_kilns_counts(preset):
    cfg = load_config(None, [f"--model.preset='{preset}'"], world_size=1).model
    adapter = family_of(cfg).export_adapter(cfg)
    hf = adapter.hf_config(cfg, "bfloat16", {})
    config_class = {"qwen3_next": "Qwen3NextConfig", "qwen3_5_text": "Qwen3_5TextConfig"}
    config = getattr(transformers, config_class[hf["model_type"]]).from_dict(hf)
    with torch.device("meta"):  # no memory; a fraction of a second for the 80B model
        model = getattr(transformers, adapter.architecture)(config)
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg).total
    # And back: the same model keys (the family's training-only ones aside).
    back = adapter.config_from_hf(hf)
    back.moe.aux_loss_weight, back.linear_attention.chunk_size = cfg.moe.aux_loss_weight, 64
    assert (back.preset, cfg.preset) == ("", preset)
    back.preset = preset
    assert back == cfg
