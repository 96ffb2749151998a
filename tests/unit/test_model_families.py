"""The model-family boundary: a family is reached only through kiln/model/registry.py, and bad
family choices are one clear error."""

import ast
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.config import ModelConfig, load_config
from kiln.config.sections import MODEL_FAMILIES
from kiln.errors import ConfigError, KilnError
from kiln.model.registry import FAMILIES, family_of, hf_adapter_for, hf_adapters

KILN = Path(__file__).resolve().parents[2] / "kiln"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_only_the_registry_imports_a_family(family):
    folder = KILN / "model" / family
    package = f"kiln.model.{family}"
    outside = [
        path.relative_to(KILN.parent).as_posix()
        for path in KILN.rglob("*.py")
        if folder not in path.parents
        and path != KILN / "model" / "registry.py"
        and any(name == package or name.startswith(f"{package}.") for name in _imports(path))
    ]
    assert outside == [], f"{outside} import {package}: go through kiln.model.registry"


def test_the_config_lists_the_registered_families():
    assert set(MODEL_FAMILIES) == set(FAMILIES)
    assert family_of(ModelConfig()).name == "llama"


def test_an_unknown_family_names_the_known_ones():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--model.family=gpt2"], world_size=1)
    assert "model.family" in str(e.value) and "'llama'" in str(e.value)


def test_an_architecture_no_family_converts_lists_those_that_are():
    hf = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(KilnError) as e:
        hf_adapter_for(hf)
    for name in ("LlamaForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen3Moe"):
        assert name in str(e.value)


def test_kiln_convert_help_names_every_architecture_a_family_converts(capsys):
    """`kiln --help` and `kiln convert --help` (with its directions) list them all."""
    for args in (["--help"], ["convert", "--help"]):
        with pytest.raises(SystemExit):
            main(args)
        flat = " ".join(capsys.readouterr().out.split()).lower().replace("-", "")
        for _, adapter in hf_adapters():
            assert adapter.architecture.removesuffix("ForCausalLM").lower() in flat, args


def test_a_head_dim_that_tensor_parallel_cannot_split_is_one_clear_error():
    overrides = ["--model.n_heads=4", "--model.n_kv_heads=2", "--model.head_dim=48"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*overrides, "--distributed.tp=4", "--train.seq_len=64"], world_size=4)
    message = str(e.value)
    assert "distributed.tp (4) must divide model.n_heads (4) and model.n_kv_heads (2)" in message
    assert "whole heads of 48" in message and "valid tp: 1, 2" in message
