"""Validation of expert parallel (`distributed.ep`): it needs a Mixture-of-Experts model whose
expert count it divides, one clear message each with the valid choices; the 32-GPU EP recipe
(the reference framework's MoE benchmark) passes at its world size."""

from __future__ import annotations

import tomllib

import pytest

from kiln.cli import main
from kiln.config import (
    JobConfig,
    ModelConfig,
    MoEConfig,
    config_from_dict,
    load_config,
    resolve_layout,
)
from kiln.config.load import MODEL_PRESET_DIR
from kiln.config.validate import collect_problems
from kiln.config.validate_moe import moe_presets
from kiln.errors import ConfigError
from tests.conftest import DEBUG_CONFIG, REPO

EP_RECIPE = REPO / "configs" / "train" / "moe_ep_32gpu.toml"
MOE_PRESETS = (
    "debug_moe, deepseek_moe_16b_like, deepseek_v2_lite, deepseek_v3_671b, deepseek_v3_debug, "
    "gpt_oss_120b, gpt_oss_20b, gpt_oss_debug, mixtral_8x7b, moe_4b, qwen3_235b_a22b, "
    "qwen3_30b_a3b, qwen3_next_80b_a3b, qwen3_next_debug"
)


def _problems(world_size: int, ep: int, **moe) -> list[str]:
    cfg = JobConfig(model=ModelConfig(moe=MoEConfig(**moe)))
    cfg.distributed.ep = ep
    return collect_problems(cfg, world_size)


def _preset_problems(preset: str, world_size: int, **distributed) -> list[str]:
    cfg = config_from_dict({"model": {"preset": preset}, "distributed": distributed})
    return collect_problems(cfg, world_size)


def test_ep_on_a_dense_preset_names_the_fix_and_the_moe_presets():
    (message,) = _preset_problems("llama3_8b", 2, ep=2)
    assert message == (
        "distributed.ep = 2 (expert parallel) splits the experts of a Mixture-of-Experts model "
        "over 2 ranks, but this model is dense (model.moe.num_experts = 0, model.preset = "
        f"'llama3_8b'): set distributed.ep = 1, or pick an MoE preset ({MOE_PRESETS})"
    )


def test_ep_on_a_dense_model_without_a_preset():
    (message,) = _problems(4, 4)
    assert "but this model is dense (model.moe.num_experts = 0, no model.preset)" in message
    assert "set distributed.ep = 1" in message


def test_the_moe_presets_listed_are_the_shipped_presets_with_experts():
    with_experts = []
    for path in sorted(MODEL_PRESET_DIR.glob("*.toml")):
        with path.open("rb") as f:
            if tomllib.load(f).get("moe", {}).get("num_experts", 0) > 0:
                with_experts.append(path.stem)
    assert moe_presets() == with_experts == MOE_PRESETS.split(", ")
    for name in with_experts:
        assert config_from_dict({"model": {"preset": name}}).model.moe.num_experts > 0


@pytest.mark.parametrize(
    ("experts", "ep", "choices"),
    [
        (8, 3, "1, 2, 4, 8 (nearest: 2 or 4)"),
        (8, 16, "1, 2, 4, 8 (nearest: 8)"),
        (6, 4, "1, 2, 3, 6 (nearest: 3 or 6)"),
    ],
)
def test_ep_must_divide_the_experts(experts, ep, choices):
    (message,) = _problems(ep, ep, num_experts=experts, top_k=2)
    assert message == (
        f"distributed.ep = {ep} must divide model.moe.num_experts = {experts} (each ep rank holds "
        f"the same number of experts); choose distributed.ep from {choices}"
    )


def test_ep_must_divide_a_preset_expert_count():
    (message,) = _preset_problems("qwen3_30b_a3b", 12, ep=3, tp=4, dp_shard=1)
    assert "distributed.ep = 3 must divide model.moe.num_experts = 128" in message
    assert "choose distributed.ep from 1, 2, 4, 8, 16, 32, 64, 128 (nearest: 2 or 4)" in message


@pytest.mark.parametrize(
    ("world_size", "distributed"),
    [
        (2, {"ep": 2}),
        (8, {"ep": 8}),
        (8, {"ep": 2, "tp": 2, "dp_shard": 2}),
        (8, {"ep": 2, "dp_replicate": 2, "dp_shard": -1}),
        (4, {"ep": 2, "pp": 2}),
        (4, {"ep": 2, "cp": 2}),
    ],
)
def test_a_valid_ep_passes(world_size, distributed):
    assert _preset_problems("debug_moe", world_size, **distributed) == []


def test_the_layout_still_counts_ep():
    # ep is its own factor of the world size: 2 × 2 on 8 processes leaves 2 unaccounted for.
    (message,) = _preset_problems("debug_moe", 8, ep=2, dp_shard=2)
    assert "make the product equal the world size (dp_shard = 4)" in message


def test_kiln_check_refuses_ep_on_the_dense_debug_recipe(capsys):
    args = ["check", str(DEBUG_CONFIG), "--world-size", "2", "--distributed.ep=2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "distributed.ep = 2 (expert parallel)" in err and "model.preset = 'debug'" in err


def test_the_32gpu_ep_recipe_is_the_reference_benchmark():
    cfg = load_config(EP_RECIPE, world_size=32)
    assert resolve_layout(cfg.distributed, 32) == {
        "dp_replicate": 1,
        "dp_shard": 4,
        "cp": 1,
        "tp": 4,
        "pp": 1,
        "ep": 2,
    }
    m, t = cfg.model, cfg.train
    assert (m.preset, m.dim, m.n_layers, m.moe.num_experts, m.moe.top_k) == (
        "moe_4b",
        2048,
        24,
        8,
        2,
    )
    assert m.moe.num_experts % cfg.distributed.ep == 0
    assert (t.batch_size, t.activation_checkpointing) == (12, "full")
    text = EP_RECIPE.read_text()
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is load-bearing" in text


@pytest.mark.parametrize("world_size", [16, 24])
def test_the_32gpu_ep_recipe_is_refused_at_another_world_size(world_size):
    with pytest.raises(ConfigError, match=f"but the world size is {world_size}"):
        load_config(EP_RECIPE, world_size=world_size)


def test_kiln_check_passes_the_32gpu_ep_recipe(capsys):
    args = ["check", str(EP_RECIPE), "--world-size", "32", "--config-only"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "dp_shard=4 × cp=1 × tp=4 × pp=1 × ep=2" in out and "config OK" in out
