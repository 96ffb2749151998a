"""Hugging Face parity: converted models give the same logits and tokens as transformers."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kiln.checkpoint import load_checkpoint, read_model_config, resolve_checkpoint, save_checkpoint
from kiln.checkpoint.hf_convert import hf_to_kiln, kiln_to_hf, model_config_from_hf, parse_size
from kiln.cli import main
from kiln.config import CheckpointConfig, JobConfig, ModelConfig
from kiln.errors import KilnError
from kiln.model import build_model, materialize
from kiln.model.generate import generate
from kiln.model.llama.model import Transformer
from kiln.model.rope import Llama3Scaling
from tests.conftest import REPO

transformers = pytest.importorskip("transformers")

VOCAB = 300
TOLERANCE = 1e-4


def _llama_config(**overrides) -> transformers.LlamaConfig:
    fields = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        # Larger than the 0.02 default so that attention is far from uniform and a wrong rotary
        # table or mask moves the logits well past the tolerance.
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="eager",
    )
    return transformers.LlamaConfig(**{**fields, **overrides})


@torch.no_grad()
def _randomize_norms(model: torch.nn.Module) -> None:
    """Norm weights start at one on both sides, which would hide a swapped or dropped norm."""
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(torch.rand(param.shape, generator=generator) + 0.5)


def _write_tokenizer(path: Path) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = ["the quick brown fox jumps over the lazy dog", "a kiln fires clay into pottery"] * 4
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(path))
    return path


def _save_hf(path: Path, **overrides) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config(**overrides)).eval()
    _randomize_norms(model)
    model.save_pretrained(path)
    return model


def _load_kiln(ckpt: Path) -> Transformer:
    step_dir = resolve_checkpoint(ckpt)
    model = materialize(build_model(read_model_config(step_dir)), device="cpu", seed=None)
    load_checkpoint(step_dir, model=model)
    return model


def _tokens(batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(2))


def _hf_greedy(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    """The tokens transformers' greedy generation adds to `prompt`."""
    out = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=new_tokens,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    _save_hf(path)
    _write_tokenizer(path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def hf_model(hf_dir) -> transformers.LlamaForCausalLM:
    return transformers.LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def kiln_ckpt(hf_dir, tmp_path_factory) -> Path:
    return hf_to_kiln(hf_dir, tmp_path_factory.mktemp("kiln") / "ckpt")


def test_hf_to_kiln_logits_match(hf_model, kiln_ckpt):
    tokens = _tokens()
    with torch.no_grad():
        expected = hf_model(tokens).logits
        got = _load_kiln(kiln_ckpt)(tokens)
    assert _max_diff(got, expected) <= TOLERANCE
    assert (kiln_ckpt / "tokenizer.json").is_file()


def test_hf_to_kiln_writes_the_layout_docs_describe(hf_dir, tmp_path, capsys):
    """docs/checkpoints.md: OUT/latest and OUT/step_00000000/ holding the tokenizer; what it
    converts is said before the weights are read."""
    out = tmp_path / "ckpt"
    hf_to_kiln(hf_dir, out)
    assert f"kiln: converting {hf_dir} (LlamaForCausalLM, " in capsys.readouterr().err
    assert (out / "latest").read_text().strip() == "step_00000000"
    for name in ("tokenizer.json", "config.toml", "train_state.json", "COMPLETE"):
        assert (out / "step_00000000" / name).is_file(), name
    assert sorted(p.name for p in out.iterdir()) == ["latest", "step_00000000"]
    doc = " ".join((REPO / "docs" / "checkpoints.md").read_text().split())
    assert "`OUT/latest` and `OUT/step_00000000/`" in doc and "OUT/tokenizer.json" not in doc


def test_hf_to_kiln_maps_config(kiln_ckpt):
    cfg = read_model_config(kiln_ckpt)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (64, 2, 4, 2)
    assert (cfg.vocab_size, cfg.ffn_hidden_dim, cfg.max_seq_len) == (VOCAB, 128, 128)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.tie_embeddings) == (500000.0, 1e-5, False)


def test_transformers_4_config_is_read(hf_dir, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    config = json.loads((src / "config.json").read_text())
    del config["rope_parameters"]
    config.update(rope_theta=250000.0, rope_scaling=None, num_key_value_heads=None)
    (src / "config.json").write_text(json.dumps(config))
    # n_kv_heads falls back to n_heads, so the 2-head k/v weights no longer fit.
    with pytest.raises(KilnError, match=r"k_proj\.weight .* has shape"):
        hf_to_kiln(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    config["num_key_value_heads"] = 2
    (src / "config.json").write_text(json.dumps(config))
    cfg = read_model_config(hf_to_kiln(src, tmp_path / "out"))
    assert (cfg.rope_theta, cfg.n_kv_heads) == (250000.0, 2)


def _save_kiln(
    tmp_path: Path, *, tied: bool = False, checkpoint: CheckpointConfig | None = None, **hf
) -> tuple[Transformer, Path]:
    """The same tiny Llama as the HF-side tests (with `hf` config changes), described in kiln's
    terms, saved as a kiln checkpoint (with a tokenizer) under tmp_path/ckpt."""
    cfg = model_config_from_hf(_llama_config(tie_word_embeddings=tied, **hf).to_dict())
    cfg.init_std = 0.1
    model = materialize(build_model(cfg), device="cpu", seed=3)
    _randomize_norms(model)
    tokenizer = _write_tokenizer(tmp_path / "tokenizer.json")
    save_checkpoint(
        tmp_path / "ckpt",
        7,
        model=model,
        optimizer=None,
        config=JobConfig(model=cfg, checkpoint=checkpoint or CheckpointConfig()),
        train_state={},
        tokenizer_path=tokenizer,
    )
    return model, tmp_path / "ckpt"


@pytest.mark.parametrize("tied", [False, True])
def test_kiln_to_hf_logits_match(tmp_path, tied):
    model, ckpt = _save_kiln(tmp_path, tied=tied)
    out = kiln_to_hf(ckpt, tmp_path / "hf")
    hf_model = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager")
    tokens = _tokens()
    with torch.no_grad():
        assert _max_diff(hf_model.eval()(tokens).logits, model(tokens)) <= TOLERANCE
    assert ("lm_head.weight" in load_file(out / "model.safetensors")) is not tied
    assert not (out / "model.safetensors.index.json").exists()


def test_sharded_export_loads_in_transformers(tmp_path, capsys):
    model, ckpt = _save_kiln(tmp_path)
    # 50 kB: the 77 kB embedding and head get a shard each, the smaller tensors share shards.
    args = ["convert", "kiln-to-hf", str(ckpt), str(tmp_path / "hf"), "--max-shard-size", "50KB"]
    assert main(args) == 0
    out = tmp_path / "hf"
    said = capsys.readouterr()
    assert f"wrote {out}" in said.out
    assert f"kiln: exporting step 7 of {ckpt} (" in said.err
    assert f"as LlamaForCausalLM in float32 to {out}" in said.err
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(path.name for path in out.glob("*.safetensors"))
    n = len(files)
    assert n > 3
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(set(index["weight_map"].values())) == files

    total = 0
    for file in files:
        shard = load_file(out / file)
        assert {k for k, v in index["weight_map"].items() if v == file} == shard.keys()
        size = sum(t.numel() * t.element_size() for t in shard.values())
        assert size <= 50_000 or len(shard) == 1, file
        total += size
    assert index["metadata"]["total_size"] == total
    assert len(index["weight_map"]) == len(model.state_dict())

    hf_model = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager")
    tokens = _tokens()
    with torch.no_grad():
        assert _max_diff(hf_model.eval()(tokens).logits, model(tokens)) <= TOLERANCE


def test_exported_files_follow_the_umask(tmp_path):
    """Every exported file gets the mode a plain write gives it: the weights are no more
    private than config.json beside them."""
    _, ckpt = _save_kiln(tmp_path)
    old = os.umask(0o022)
    try:
        assert main(["convert", "kiln-to-hf", str(ckpt), str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "hf").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes


def test_export_dtype_comes_from_the_checkpoint(tmp_path):
    _, ckpt = _save_kiln(tmp_path, checkpoint=CheckpointConfig(export_dtype="bfloat16"))

    def exported(out: Path) -> tuple[set[torch.dtype], str]:
        """The dtypes of the weights, and the dtype config.json names."""
        weights = load_file(out / "model.safetensors")
        config = json.loads((out / "config.json").read_text())
        return {t.dtype for t in weights.values()}, config["torch_dtype"]

    assert exported(kiln_to_hf(ckpt, tmp_path / "default")) == ({torch.bfloat16}, "bfloat16")
    # An explicit dtype wins over the checkpoint's.
    out = kiln_to_hf(ckpt, tmp_path / "fp16", dtype="float16")
    assert exported(out) == ({torch.float16}, "float16")
    # A checkpoint from before checkpoint.export_dtype existed exports float32. (Its marker held
    # only the step, so the edited config.toml is not taken for a damaged file.)
    step_dir = resolve_checkpoint(ckpt)
    lines = (step_dir / "config.toml").read_text().splitlines()
    (step_dir / "config.toml").write_text("\n".join(x for x in lines if "export_dtype" not in x))
    (step_dir / "COMPLETE").write_text("7\n")
    assert exported(kiln_to_hf(ckpt, tmp_path / "old")) == ({torch.float32}, "float32")


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (1000, 1000),
        ("1000", 1000),
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("500mb", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1.5 KB", 1500),
    ],
)
def test_parse_size(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["", "five GB", "5XB", "5GB5", "0", "-1", "0MB"])
def test_bad_max_shard_size_is_one_clear_error(tmp_path, capsys, size):
    with pytest.raises(KilnError, match="max shard size"):
        parse_size(size)
    # The CLI says so in one line before reading the checkpoint, and writes nothing.
    args = ["convert", "kiln-to-hf", str(tmp_path / "nowhere"), str(tmp_path / "hf")]
    assert main([*args, f"--max-shard-size={size}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln convert: error:") and "max shard size" in err
    assert err.count("\n") == 1
    assert not (tmp_path / "hf").exists()


def test_exported_tokenizer_loads_in_transformers(kiln_ckpt, tmp_path):
    out = kiln_to_hf(kiln_ckpt, tmp_path / "hf")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "the lazy kiln jumps"
    assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == ours.encode(text).ids
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] == ours.token_to_id("<|bos|>")
    assert config["eos_token_id"] == ours.token_to_id("<|eos|>")
    assert hf_tokenizer.eos_token == "<|eos|>"


def test_greedy_generation_matches_hf(hf_model, kiln_ckpt):
    prompt = [5, 17, 42, 99, 250]
    expected = _hf_greedy(hf_model, prompt, 12)
    assert generate(_load_kiln(kiln_ckpt), prompt, max_new_tokens=12) == expected


def test_round_trip_is_exact(hf_dir, kiln_ckpt, tmp_path):
    out = kiln_to_hf(kiln_ckpt, tmp_path / "hf")
    original = load_file(hf_dir / "model.safetensors")
    exported = load_file(out / "model.safetensors")
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name


def test_sharded_and_tied_hf_checkpoint(tmp_path):
    hf_model = _save_hf(tmp_path / "hf", tie_word_embeddings=True)
    _shard(tmp_path / "hf")
    ckpt = hf_to_kiln(tmp_path / "hf", tmp_path / "kiln")
    tokens = _tokens()
    with torch.no_grad():
        assert _max_diff(_load_kiln(ckpt)(tokens), hf_model(tokens).logits) <= TOLERANCE


def _shard(hf_dir: Path) -> None:
    """Split model.safetensors in two files with an index, as save_pretrained does for big models."""
    tensors = load_file(hf_dir / "model.safetensors")
    (hf_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, hf_dir / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "kiln converts Llama"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "RoPE scaling 'yarn'"),
        (
            {"rope_scaling": {"type": "llama3", "factor": 8.0}},
            "'llama3' RoPE scaling without low_freq_factor, high_freq_factor, original_max_pos",
        ),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_hf_configs_are_refused(hf_dir, tmp_path, change, message):
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    config = json.loads((src / "config.json").read_text())
    config.pop("rope_parameters", None)
    (src / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(KilnError, match=message):
        hf_to_kiln(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_tensor_is_named(hf_dir, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(1)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KilnError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]") as e:
        hf_to_kiln(src, tmp_path / "out")
    assert "model.layers.1.mlp.extra.weight" in str(e.value)


def test_non_empty_out_dir_is_refused(hf_dir, kiln_ckpt, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(KilnError, match="not empty"):
        hf_to_kiln(hf_dir, tmp_path)
    with pytest.raises(KilnError, match="not empty"):
        kiln_to_hf(kiln_ckpt, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_not_a_kiln_checkpoint_is_refused(hf_dir, tmp_path):
    with pytest.raises(KilnError, match="not a kiln checkpoint"):
        kiln_to_hf(hf_dir, tmp_path / "out")


def test_dense_qk_norm_model_exports_as_qwen3(tmp_path):
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=64, qk_norm=True)
    model = materialize(build_model(cfg), device="cpu", seed=0)
    save_checkpoint(
        tmp_path / "ckpt",
        0,
        model=model,
        optimizer=None,
        config=JobConfig(model=cfg),
        train_state={},
    )
    kiln_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["Qwen3ForCausalLM"], "qwen3")


# Llama 3.1-style RoPE scaling, shrunk: a 64-token original context that LONG tokens run past.
# With head_dim 16 the frequencies make about 10, 2, 0.4, ... turns over those 64 positions, so
# one is kept, one blended and the rest stretched: every branch of the rule is exercised.
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# Llama 3.2 (1B, 3B): tied embeddings and a stronger stretch.
LLAMA32_ROPE = {**LLAMA31_ROPE, "factor": 32.0}
LONG = 96
LLAMA3_VARIANTS = pytest.mark.parametrize(
    ("rope", "tied"), [(LLAMA31_ROPE, False), (LLAMA32_ROPE, True)], ids=["3.1", "3.2-tied"]
)


def test_llama3_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _llama_config(rope_parameters=LLAMA31_ROPE)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / 500000.0 ** (torch.arange(0, 16, 2).float() / 16)
    got = Llama3Scaling(8.0, 1.0, 4.0, 64).apply(plain)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    assert got[0] == plain[0] and got[-1] == plain[-1] / 8  # kept / stretched ends


@LLAMA3_VARIANTS
def test_llama3_rope_scaling_hf_to_kiln_logits_match(tmp_path, rope, tied):
    hf_model = _save_hf(tmp_path / "hf", rope_parameters=rope, tie_word_embeddings=tied)
    ckpt = hf_to_kiln(tmp_path / "hf", tmp_path / "kiln")
    cfg = read_model_config(ckpt)
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.tie_embeddings) == (
        "llama3",
        rope["factor"],
        tied,
    )
    assert (cfg.rope_low_freq_factor, cfg.rope_high_freq_factor) == (1.0, 4.0)
    assert cfg.rope_original_max_seq_len == 64
    model, tokens = _load_kiln(ckpt), _tokens(seq=LONG)
    with torch.no_grad():
        expected = hf_model(tokens).logits
        assert _max_diff(model(tokens), expected) <= TOLERANCE
        # The scaling matters here: the same weights with plain RoPE are far off.
        plain = build_model(dataclasses.replace(cfg, rope_scaling="none"))
        plain = materialize(plain, device="cpu", seed=None)
        plain.load_state_dict(model.state_dict())
        assert _max_diff(plain(tokens), expected) > 100 * TOLERANCE


@LLAMA3_VARIANTS
def test_llama3_rope_scaling_kiln_to_hf_round_trip(tmp_path, rope, tied):
    model, ckpt = _save_kiln(tmp_path, tied=tied, rope_parameters=rope)
    out = kiln_to_hf(ckpt, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"] == rope
    assert config["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    hf_model = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert hf_model.config.rope_parameters == rope
    tokens = _tokens(seq=LONG)
    with torch.no_grad():
        assert _max_diff(hf_model.eval()(tokens).logits, model(tokens)) <= TOLERANCE
    back = hf_to_kiln(out, tmp_path / "back")
    assert read_model_config(back) == read_model_config(resolve_checkpoint(ckpt))
    for name, tensor in _load_kiln(back).state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
