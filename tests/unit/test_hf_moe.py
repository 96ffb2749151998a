"""Hugging Face parity of Mixture-of-Experts models (Mixtral, Qwen3-MoE): converted models give
the same logits and tokens as transformers, both ways, and what cannot be expressed is refused."""

from __future__ import annotations

import dataclasses
import json
from operator import attrgetter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.checkpoint import find_tokenizer, read_model_config, resolve_checkpoint, save_checkpoint
from kiln.checkpoint.hf_convert import hf_to_kiln, kiln_to_hf, model_config_from_hf
from kiln.cli import main
from kiln.config import JobConfig, ModelConfig
from kiln.data.tokenizer import load_tokenizer
from kiln.errors import KilnError
from kiln.model import build_model, materialize
from kiln.model.generate import generate
from kiln.model.llama.model import Transformer
from tests.unit.test_hf_convert import (
    TOLERANCE,
    VOCAB,
    _hf_greedy,
    _load_kiln,
    _max_diff,
    _randomize_norms,
    _tokens,
    _write_tokenizer,
)

transformers = pytest.importorskip("transformers")

COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    # Larger than the 0.02 default: attention far from uniform and router probabilities far
    # apart, so a wrong routing rule moves the logits well past the tolerance.
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    attn_implementation="eager",
)
# Tiny models of each family. qwen3-sparse: MoE blocks 1 and 3 of 4, dense ones wider.
VARIANTS = {
    "mixtral": dict(
        model_type="mixtral",
        num_hidden_layers=2,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    # Mixtral's sliding window (every block), 6 of the tests' 24 tokens.
    "mixtral-windowed": dict(
        model_type="mixtral",
        num_hidden_layers=2,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        sliding_window=6,
    ),
    "qwen3": dict(
        model_type="qwen3_moe",
        num_hidden_layers=3,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[0],
    ),
    "qwen3-sparse": dict(
        model_type="qwen3_moe",
        num_hidden_layers=4,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        tie_word_embeddings=True,
    ),
}
EACH_VARIANT = pytest.mark.parametrize("variant", list(VARIANTS))


def _hf_config(variant: str, **overrides) -> transformers.PreTrainedConfig:
    fields = {**COMMON, **VARIANTS[variant], **overrides}
    config_class = transformers.AutoConfig.for_model(fields.pop("model_type")).__class__
    return config_class(**fields)


def _save_hf(path: Path, variant: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(variant)).eval()
    _randomize_norms(model)
    model.save_pretrained(path)
    _write_tokenizer(path / "tokenizer.json")
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, transformers.PreTrainedModel, Path]]:
    """Per variant: the HF folder save_pretrained wrote, the HF model, and the kiln checkpoint."""
    out = {}
    for variant in VARIANTS:
        root = tmp_path_factory.mktemp(variant)
        model = _save_hf(root / "hf", variant)
        out[variant] = (root / "hf", model, hf_to_kiln(root / "hf", root / "kiln"))
    return out


@EACH_VARIANT
def test_hf_to_kiln_logits_match(converted, variant):
    _, hf_model, ckpt = converted[variant]
    model, tokens = _load_kiln(ckpt), _tokens()
    with torch.no_grad():
        expected = hf_model(tokens).logits
        assert _max_diff(model(tokens), expected) <= TOLERANCE
        # The routing rule matters: the same weights with the other renormalization are far off.
        flipped = dataclasses.replace(model.cfg.moe, route_norm=not model.cfg.moe.route_norm)
        other = dataclasses.replace(model.cfg, moe=flipped)
        other_model = materialize(build_model(other), device="cpu", seed=None)
        other_model.load_state_dict(model.state_dict())
        assert _max_diff(other_model(tokens), expected) > 100 * TOLERANCE
    biases = [b for name, b in model.named_buffers() if name.endswith("expert_bias")]
    assert biases and all(not b.any() for b in biases)


@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        ("mixtral", {"n_layers": 2, "moe.num_experts": 4, "moe.top_k": 2, "moe.route_norm": True}),
        ("qwen3", {"qk_norm": True, "moe.route_norm": False, "moe.first_dense_layers": 1}),
        ("qwen3-sparse", {"moe.frequency": 2, "moe.first_dense_layers": 1, "moe.top_k": 3}),
    ],
)
def test_hf_to_kiln_maps_config(converted, variant, expected):
    cfg = read_model_config(converted[variant][2])
    assert {key: attrgetter(key)(cfg) for key in expected} == expected
    assert cfg.moe.router == "softmax_topk" and cfg.moe.shared_experts == 0
    assert cfg.qk_norm is (variant != "mixtral")
    hf = VARIANTS[variant]
    assert cfg.expert_hidden_dim == hf.get("moe_intermediate_size", hf["intermediate_size"])
    assert cfg.ffn_hidden_dim == hf["intermediate_size"]
    moe = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
    assert moe == {"mixtral": [0, 1], "qwen3": [1, 2], "qwen3-sparse": [1, 3]}[variant]


@EACH_VARIANT
def test_round_trip_is_exact(converted, variant, tmp_path):
    """HF -> kiln -> HF writes what save_pretrained wrote: the same names (one tensor per
    expert) and the same values."""
    hf_dir, _, ckpt = converted[variant]
    out = kiln_to_hf(ckpt, tmp_path / "hf")
    original, exported = (
        load_file(hf_dir / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name


@pytest.mark.parametrize("variant", ["mixtral", "qwen3"])
def test_fused_expert_layout_is_read(converted, variant, tmp_path):
    """The layout of transformers 5's modules (gate_up_proj, down_proj: 3-D tensors), as a
    checkpoint saved from the state dict holds it, converts to the same kiln weights."""
    _, hf_model, ckpt = converted[variant]
    hf_model.config.save_pretrained(tmp_path / "fused")
    state = {name: t.contiguous() for name, t in hf_model.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, tmp_path / "fused" / "model.safetensors", metadata={"format": "pt"})
    fused = _load_kiln(hf_to_kiln(tmp_path / "fused", tmp_path / "kiln")).state_dict()
    for name, tensor in _load_kiln(ckpt).state_dict().items():
        assert torch.equal(tensor, fused[name]), name


def _kiln_cfg(variant: str, moe: dict | None = None, **changes) -> ModelConfig:
    """The kiln model of `variant`, with these [model] keys and [model.moe] keys (`moe`) changed."""
    cfg = model_config_from_hf(_hf_config(variant).to_dict())
    moe_cfg = dataclasses.replace(cfg.moe, **(moe or {}))
    return dataclasses.replace(cfg, init_std=0.1, moe=moe_cfg, **changes)


def _save_kiln(tmp_path: Path, cfg: ModelConfig) -> tuple[Transformer, Path]:
    model = materialize(build_model(cfg), device="cpu", seed=3)
    _randomize_norms(model)
    save_checkpoint(
        tmp_path / "ckpt",
        5,
        model=model,
        optimizer=None,
        config=JobConfig(model=cfg),
        train_state={},
        tokenizer_path=_write_tokenizer(tmp_path / "tokenizer.json"),
    )
    return model, tmp_path / "ckpt"


# kiln MoE models and the HF class each is exported as; the last two put the MoE blocks where
# decoder_sparse_step alone cannot (every other block from block 0) and where it can (from 1).
EXPORTS = pytest.mark.parametrize(
    ("variant", "changes", "hf_class"),
    [
        ("mixtral", {}, "MixtralForCausalLM"),
        ("mixtral", {"tie_embeddings": True}, "MixtralForCausalLM"),
        ("qwen3", {}, "Qwen3MoeForCausalLM"),
        ("qwen3", {"n_layers": 4, "moe": {"frequency": 2, "first_dense_layers": 0}}, "Qwen3Moe"),
        ("qwen3", {"n_layers": 4, "moe": {"frequency": 2, "first_dense_layers": 1}}, "Qwen3Moe"),
    ],
    ids=["mixtral", "mixtral-tied", "qwen3", "qwen3-even", "qwen3-odd"],
)


@EXPORTS
def test_kiln_to_hf_logits_match(tmp_path, variant, changes, hf_class):
    model, ckpt = _save_kiln(tmp_path, _kiln_cfg(variant, **changes))
    out = tmp_path / "hf"
    # Sharded: the experts of one stacked parameter land in several files.
    assert main(["convert", "kiln-to-hf", str(ckpt), str(out), "--max-shard-size", "30KB"]) == 0
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) > 20
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(hf_model).__name__.startswith(hf_class)
    layers = hf_model.model.layers
    moe = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]
    assert moe == [i for i in range(model.cfg.n_layers) if model.cfg.is_moe_layer(i)]
    tokens = _tokens()
    with torch.no_grad():
        assert _max_diff(hf_model.eval()(tokens).logits, model(tokens)) <= TOLERANCE
    back = hf_to_kiln(out, tmp_path / "back")
    for name, tensor in _load_kiln(back).state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


@EACH_VARIANT
def test_greedy_generation_matches_hf(converted, variant):
    _, hf_model, ckpt = converted[variant]
    prompt = [5, 17, 42, 99, 250]
    expected = _hf_greedy(hf_model, prompt, 10)
    assert generate(_load_kiln(ckpt), prompt, max_new_tokens=10) == expected


def test_kiln_generate_cli_on_moe_checkpoint(converted, capsys):
    ckpt = converted["qwen3"][2]
    args = ["generate", str(ckpt), "--prompt", "the quick", "--max-new-tokens", "6"]
    assert main([*args, "--device", "cpu"]) == 0
    tokenizer = load_tokenizer(find_tokenizer(ckpt))
    new = generate(_load_kiln(ckpt), tokenizer.encode("the quick").ids, max_new_tokens=6)
    assert capsys.readouterr().out == "the quick" + tokenizer.decode(new) + "\n"


def _write_config(path: Path, config: dict) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "config_class", ["Qwen2MoeConfig", "DeepseekV2Config", "OlmoeConfig", "MiniMaxConfig"]
)
def test_unsupported_moe_family_is_one_clear_error(tmp_path, capsys, config_class):
    config = getattr(transformers, config_class)().to_dict()
    hf_dir = _write_config(tmp_path / "hf", config)  # no weights: refused before reading them
    with pytest.raises(KilnError) as e:
        hf_to_kiln(hf_dir, tmp_path / "out")
    message = str(e.value)
    assert message.startswith("unsupported Mixture-of-Experts model")
    assert repr(config["model_type"]) in message and "'mixtral'" in message
    assert "'qwen3_moe'" in message
    assert main(["convert", "hf-to-kiln", str(hf_dir), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("variant", "change", "message"),
    [
        # MoE blocks 0, 2, 3 of 4: no every-k-th rule makes that choice.
        ("qwen3", {"num_hidden_layers": 4, "mlp_only_layers": [1]}, r"MoE blocks \[0, 2, 3\]"),
        ("qwen3", {"mlp_only_layers": [0, 1, 2]}, "no MoE block"),
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_variants_are_refused(converted, tmp_path, variant, change, message):
    hf_dir = converted[variant][0]
    config = json.loads((hf_dir / "config.json").read_text())
    # Refused from config.json alone, before the weights are read.
    _write_config(tmp_path / "hf", {**config, **change})
    with pytest.raises(KilnError, match=message):
        hf_to_kiln(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_nonzero_expert_bias_is_not_exported(tmp_path):
    cfg = _kiln_cfg("mixtral", moe={"bias_update_rate": 0.001})
    model = materialize(build_model(cfg), device="cpu", seed=3)
    model.layers["1"].feed_forward.router.expert_bias.copy_(torch.tensor([0.1, 0, 0, -0.1]))
    save_checkpoint(
        tmp_path / "ckpt",
        1,
        model=model,
        optimizer=None,
        config=JobConfig(model=cfg),
        train_state={},
    )
    with pytest.raises(KilnError, match=r"layers\.1\.feed_forward\.router\.expert_bias") as e:
        kiln_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert "other experts" in str(e.value) and "Mixtral" in str(e.value)
    assert not (tmp_path / "hf").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize(
    ("variant", "change", "message"),
    [
        ("mixtral", {"router": "sigmoid"}, r"moe\.router = 'sigmoid'"),
        ("mixtral", {"route_scale": 2.5}, r"moe\.route_scale = 2\.5"),
        ("mixtral", {"route_norm": False}, r"moe\.route_norm = false"),
        ("mixtral", {"first_dense_layers": 1}, "dense blocks"),
        ("qwen3", {"shared_experts": 1}, r"moe\.shared_experts = 1"),
        ("qwen3", {"n_groups": 2, "topk_groups": 1}, "group-limited routing"),
    ],
)
def test_unexportable_moe_models_are_refused(tmp_path, variant, change, message):
    _, ckpt = _save_kiln(tmp_path, _kiln_cfg(variant, moe=change))
    family = "Mixtral" if variant == "mixtral" else "Qwen3-MoE"
    with pytest.raises(
        KilnError,
        match=f"(?i)cannot export this model as {family.replace('-', '')}ForCausalLM.*{message}",
    ):
        kiln_to_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_exported_config_names_the_family(converted, tmp_path):
    out = kiln_to_hf(resolve_checkpoint(converted["qwen3-sparse"][2]), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    expected = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": 6,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 32,
        "intermediate_size": 96,
        "norm_topk_prob": True,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [],
        "tie_word_embeddings": True,
    }
    assert {key: config[key] for key in expected} == expected
