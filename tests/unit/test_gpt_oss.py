"""gpt-oss (docs/models.md): tiny random GptOssForCausalLM models convert to kiln with the logits
and greedy tokens of transformers, export back bit for bit, import MXFP4-packed experts as
transformers dequantizes them, and the presets count exactly transformers' parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.checkpoint.hf_convert import hf_to_kiln, kiln_to_hf
from kiln.config import load_config
from kiln.errors import KilnError
from kiln.model import count_params
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

# gpt-oss shrunk: 4 heads of 16 on hidden 64 (2 KV heads), 3 blocks alternating a window of 4 of
# the tests' 24 tokens with full attention, 4 experts 32 wide (2 per token), YaRN over an
# original context of 16 (factor 4, ramp ends not rounded), a limit low enough that the clamps
# bind (the activations here reach about ±3).
CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    sliding_window=4,
    swiglu_limit=1.5,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 16,
    },
    # Larger than the 0.02 default: attention far from uniform, routers far apart, so a wrong
    # bias, sink, clamp or rotary table moves the logits well past TOLERANCE.
    initializer_range=0.2,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    attn_implementation="eager",
)


def _hf_model(**overrides) -> transformers.GptOssForCausalLM:
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**CONFIG, **overrides}))
    with torch.no_grad():
        _randomize_norms(model)
        for name, param in model.named_parameters():  # biases start at zero: make them count
            if "bias" in name:
                param.copy_(torch.randn(param.shape) * 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, transformers.PreTrainedModel, Path]:
    root = tmp_path_factory.mktemp("gpt_oss")
    model = _hf_model()
    model.save_pretrained(root / "hf")
    _write_tokenizer(root / "hf" / "tokenizer.json")
    return root / "hf", model, hf_to_kiln(root / "hf", root / "kiln")


def test_the_config_maps_onto_the_block(converted):
    model = _load_kiln(converted[2])
    cfg = model.cfg
    assert [cfg.attention_window(i) for i in range(3)] == [4, 0, 4]
    assert cfg.attention_sinks and cfg.attention_bias and cfg.moe.bias
    assert (cfg.moe.activation, cfg.moe.swiglu_limit, cfg.rope_yarn_truncate) == (
        "clamped_swiglu",
        1.5,
        False,
    )
    assert model.layers["0"].feed_forward.experts.b2.shape == (4, 64)


def test_logits_and_greedy_tokens_match_transformers(converted):
    _, hf_model, ckpt = converted
    model, tokens = _load_kiln(ckpt), _tokens()
    with torch.no_grad():
        diff = _max_diff(model(tokens), hf_model(tokens).logits)
    # fp32, the same math in another order (SDPA-less written-out softmax vs eager, stacked
    # experts vs per-expert matmuls): rounding, about 1e-6; a wrong bias, sink, window, clamp,
    # interleave or YaRN table moves the logits by 1e-2 or more.
    assert diff <= TOLERANCE, diff
    prompt = [5, 17, 42, 99, 250]
    expected = _hf_greedy(hf_model, prompt, 10)
    assert generate(model, prompt, max_new_tokens=10) == expected


def test_export_writes_back_every_tensor_bit_for_bit(converted, tmp_path):
    hf_dir, hf_model, ckpt = converted
    out = kiln_to_hf(ckpt, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"] and "quantization_config" not in config
    original, exported = (
        load_file(hf_dir / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    loaded = transformers.GptOssForCausalLM.from_pretrained(out, attn_implementation="eager")
    with torch.no_grad():
        assert _max_diff(loaded(_tokens()).logits, hf_model(_tokens()).logits) == 0


def test_mxfp4_experts_import_as_transformers_dequantizes_them(converted, tmp_path):
    """The released form: each expert projection as `_blocks` (FP4 pairs) and `_scales` (E8M0),
    here random codes the test packs; kiln's import against a transformers model given the
    weights transformers' own dequantization makes of them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_dir, _, _ = converted
    tensors = load_file(hf_dir / "model.safetensors")
    reference = _hf_model()
    generator = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        experts, columns, rows = tensors.pop(name).shape  # (experts, in, out)
        blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), dtype=torch.uint8,
                               generator=generator)  # fmt: skip
        scales = torch.randint(120, 126, (experts, rows, columns // 32), dtype=torch.uint8,
                               generator=generator)  # fmt: skip
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        with torch.no_grad():
            weight = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            reference.get_parameter(name).copy_(weight)
    packed = tmp_path / "packed"
    packed.mkdir()
    save_file(tensors, packed / "model.safetensors")
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (packed / "config.json").write_text(json.dumps(config))
    model = _load_kiln(hf_to_kiln(packed, tmp_path / "kiln"))
    with torch.no_grad():
        assert _max_diff(model(_tokens()), reference(_tokens()).logits) <= TOLERANCE  # as above


def test_a_checkpoint_quantized_otherwise_is_refused(converted, tmp_path):
    hf_dir = converted[0]
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(KilnError, match="quantization_config 'fp8'"):
        hf_to_kiln(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("name", "published"), [("gpt_oss_20b", (20.9, 3.6)), ("gpt_oss_120b", (116.8, 5.1))]
)
def test_presets_count_transformers_parameters(name, published):
    """kiln's count equals transformers' model built from the released numbers (on meta); the
    active count without the embedding is OpenAI's published figure (3.6B and 5.1B)."""
    cfg = load_config(None, [f"--model.preset='{name}'"], world_size=1).model
    hf_config = transformers.GptOssConfig(
        hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        intermediate_size=cfg.expert_hidden_dim, num_local_experts=cfg.moe.num_experts,
        num_experts_per_tok=cfg.moe.top_k,
    )  # fmt: skip
    with torch.device("meta"):
        hf_total = sum(p.numel() for p in transformers.GptOssForCausalLM(hf_config).parameters())
    counted = count_params(cfg)
    assert counted.total == hf_total
    embedding = cfg.vocab_size * cfg.dim
    assert (
        round(counted.total / 1e9, 1),
        round((counted.active - embedding) / 1e9, 1),
    ) == published
