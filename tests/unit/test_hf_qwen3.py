"""Hugging Face parity of Qwen3 (dense) and Qwen3-MoE in the shape their releases have: a head
width of its own (head_dim 128 on hidden 2048 with 32 heads in the real ones: queries wider than
the residual stream), q/k RMSNorms, tied and untied embeddings, and (MoE) experts narrower than
the dense feed-forward with renormalized top-k routing in every block. Both ways: HF -> kiln gives
transformers' logits and greedy tokens, kiln -> HF loads in transformers with the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.checkpoint import read_model_config
from kiln.checkpoint.hf_convert import hf_to_kiln, kiln_to_hf
from kiln.cli import main
from kiln.errors import KilnError
from kiln.model.generate import generate
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

# A released Qwen3 shrunk: 4 heads of 32 on hidden 64, so queries are 128 wide (twice the
# residual stream, as 32 x 128 on 2048 is in Qwen3-1.7B / Qwen3-30B-A3B), and 2 KV heads.
HEAD_DIM = 32
COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=HEAD_DIM,
    num_hidden_layers=2,
    intermediate_size=96,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    # Larger than the 0.02 default: attention far from uniform and router probabilities far
    # apart, so a wrong head split, norm or routing rule moves the logits well past TOLERANCE.
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    attn_implementation="eager",
)
# Qwen3-30B-A3B's rule shrunk: every block MoE (decoder_sparse_step 1, no mlp_only_layers),
# experts narrower than intermediate_size, top-k weights renormalized.
MOE = dict(
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
# Sliding-window attention turned on, a window of 4 of the tests' 24 tokens: on the blocks from
# max_window_layers (here the second) for Qwen3, on every block for Qwen3-MoE.
WINDOW = {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
# variant -> (HF class name, config class name, config fields beyond COMMON).
VARIANTS = {
    "dense": ("Qwen3ForCausalLM", "Qwen3Config", {"tie_word_embeddings": False}),
    "dense-tied": ("Qwen3ForCausalLM", "Qwen3Config", {"tie_word_embeddings": True}),
    "dense-windowed": ("Qwen3ForCausalLM", "Qwen3Config", {"tie_word_embeddings": False, **WINDOW}),
    "moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", {**MOE, "tie_word_embeddings": False}),
    "moe-windowed": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {**MOE, "tie_word_embeddings": False, **WINDOW},
    ),
}
EACH_VARIANT = pytest.mark.parametrize("variant", list(VARIANTS))


def _hf_class(variant: str) -> type:
    return getattr(transformers, VARIANTS[variant][0])


def _save_hf(path: Path, variant: str) -> transformers.PreTrainedModel:
    _, config_class, fields = VARIANTS[variant]
    config = getattr(transformers, config_class)(**{**COMMON, **fields})
    assert config.head_dim * config.num_attention_heads != config.hidden_size
    torch.manual_seed(0)
    model = _hf_class(variant)(config).eval()
    _randomize_norms(model)  # q_norm and k_norm included
    model.save_pretrained(path)
    _write_tokenizer(path / "tokenizer.json")
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, transformers.PreTrainedModel, Path]]:
    """Per variant: the folder save_pretrained wrote, the HF model, and the kiln checkpoint."""
    out = {}
    for variant in VARIANTS:
        root = tmp_path_factory.mktemp(variant)
        model = _save_hf(root / "hf", variant)
        out[variant] = (root / "hf", model, hf_to_kiln(root / "hf", root / "kiln"))
    return out


@EACH_VARIANT
def test_hf_to_kiln_maps_the_shape(converted, variant):
    hf_dir, _, ckpt = converted[variant]
    cfg = read_model_config(ckpt)
    assert (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.n_layers) == (64, 4, 2, 2)
    assert (cfg.head_dim, cfg.resolved_head_dim) == (HEAD_DIM, HEAD_DIM)
    assert cfg.qk_norm and cfg.tie_embeddings is variant.endswith("-tied")
    assert (cfg.rope_theta, cfg.norm_eps) == (1000000.0, 1e-6)
    if variant.startswith("moe"):
        assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.expert_hidden_dim) == (4, 2, 32)
        assert cfg.moe.route_norm and cfg.moe.router == "softmax_topk"
        assert all(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    else:
        assert (cfg.moe.num_experts, cfg.ffn_hidden_dim) == (0, 96)
    windows = {"dense-windowed": [0, 4], "moe-windowed": [4, 4]}.get(variant, [0, 0])
    assert [cfg.attention_window(i) for i in range(cfg.n_layers)] == windows
    wq = _load_kiln(ckpt).layers["0"].attention.wq.weight
    assert wq.shape == (4 * HEAD_DIM, 64)
    assert ("lm_head.weight" in load_file(hf_dir / "model.safetensors")) is not cfg.tie_embeddings


@EACH_VARIANT
def test_hf_to_kiln_logits_and_tokens_match(converted, variant):
    _, hf_model, ckpt = converted[variant]
    model, tokens = _load_kiln(ckpt), _tokens()
    with torch.no_grad():
        diff = _max_diff(model(tokens), hf_model(tokens).logits)
    # TOLERANCE (1e-4, fp32): the same math in another order (kiln's SDPA vs transformers' eager
    # attention, stacked vs per-expert expert matmuls) differs only by fp32 rounding, about 2e-6
    # here; a wrong head split, q/k norm, rotary table or routing rule is off by far more.
    assert diff <= TOLERANCE, diff

    prompt = [5, 17, 42, 99, 250]
    expected = _hf_greedy(hf_model, prompt, 10)
    assert generate(model, prompt, max_new_tokens=10) == expected


@EACH_VARIANT
def test_kiln_to_hf_loads_with_the_same_logits(converted, variant, tmp_path):
    hf_dir, hf_model, ckpt = converted[variant]
    out = kiln_to_hf(ckpt, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    expected = {
        "architectures": [VARIANTS[variant][0]],
        "head_dim": HEAD_DIM,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": variant.endswith("-tied"),
    }
    if variant.startswith("moe"):
        expected.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if variant.endswith("windowed"):
        expected.update(use_sliding_window=True, sliding_window=4)
    assert {key: config[key] for key in expected} == expected

    # What save_pretrained wrote comes back: the same names and values.
    original, exported = (
        load_file(hf_dir / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name

    loaded = _hf_class(variant).from_pretrained(out, attn_implementation="eager").eval()
    assert type(loaded).__name__ == VARIANTS[variant][0]
    assert loaded.config.head_dim == HEAD_DIM
    tokens = _tokens()
    with torch.no_grad():
        diff = _max_diff(loaded(tokens).logits, hf_model(tokens).logits)
        kiln_diff = _max_diff(loaded(tokens).logits, _load_kiln(ckpt)(tokens))
    assert diff <= TOLERANCE, diff  # same weights, same code: in practice exactly equal
    assert kiln_diff <= TOLERANCE, kiln_diff  # fp32 rounding, as above


def test_cli_converts_qwen3(converted, tmp_path, capsys):
    hf_dir, hf_model, _ = converted["dense"]
    assert main(["convert", "hf-to-kiln", str(hf_dir), str(tmp_path / "kiln")]) == 0
    assert str(tmp_path / "kiln") in capsys.readouterr().out
    tokens = _tokens()
    with torch.no_grad():
        got = _load_kiln(tmp_path / "kiln")(tokens)
        assert _max_diff(got, hf_model(tokens).logits) <= TOLERANCE


YARN = {
    "rope_type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.mark.parametrize(
    ("variant", "change", "message"),
    [
        ("dense", {"attention_bias": True}, "attention_bias = true"),
        ("dense", {"rope_parameters": YARN}, "RoPE scaling 'yarn'"),
        # transformers 4.x's spelling of the same.
        (
            "dense",
            {"rope_parameters": None, "rope_theta": 1e6, "rope_scaling": YARN},
            "RoPE scaling 'yarn'",
        ),
        (
            "dense",
            {"layer_types": ["full_attention", "chunked_attention"]},
            r"layer_types \['chunked_attention'\] \(kiln knows",
        ),
        ("dense", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("moe", {"attention_bias": True}, "attention_bias = true"),
        ("moe", {"rope_parameters": YARN}, "RoPE scaling 'yarn'"),
        ("moe", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_qwen3_configs_are_refused(
    converted, tmp_path, capsys, variant, change, message
):
    config = json.loads((converted[variant][0] / "config.json").read_text())
    # config.json alone, no weights: refused before they are read, and before out is made.
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({**config, **change}))
    family = "Qwen3-MoE" if variant == "moe" else "Qwen3"
    with pytest.raises(KilnError, match=f"cannot convert this {family} variant: .*{message}"):
        hf_to_kiln(hf_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["convert", "hf-to-kiln", str(hf_dir), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "change",
    [
        # Every release: the window is off, whatever it says (transformers ignores it then).
        {"use_sliding_window": False, "sliding_window": 16},
        # A window as long as the context changes nothing.
        {"use_sliding_window": True, "sliding_window": 128},
        {"layer_types": ["full_attention", "full_attention"]},
    ],
)
def test_windows_that_change_nothing_convert(converted, tmp_path, change):
    hf_dir, hf_model, _ = converted["dense"]
    src = tmp_path / "hf"
    src.mkdir()
    for file in hf_dir.iterdir():
        (src / file.name).write_bytes(file.read_bytes())
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **change}))
    tokens = _tokens()
    with torch.no_grad():
        got = _load_kiln(hf_to_kiln(src, tmp_path / "kiln"))(tokens)
        assert _max_diff(got, hf_model(tokens).logits) <= TOLERANCE
