"""The reference framework's recipes (the 7B, 13B and 70B layouts kiln ships) and the MoE ones
exist with their meshes and pass validation at their GPU counts, and ship with the package."""

from pathlib import Path

import pytest

from kiln.config import load_config, resolve_layout
from kiln.config.load import RECIPE_DIR, SHIPPED_CONFIGS, find_recipe
from kiln.errors import ConfigError
from kiln.metrics.layout_report import startup_summary
from tests.conftest import REPO

RECIPES = {
    "7b": (4, {"dp_shard": 4, "tp": 1}),
    "7b_12gpu_tp4": (12, {"dp_shard": 3, "tp": 4}),
    "7b_32gpu_fsdp": (32, {"dp_shard": 32, "tp": 1}),
    "7b_16gpu_adamw": (16, {"dp_shard": 16, "tp": 1}),
    "7b_16gpu_preemptible": (16, {"dp_shard": 16, "tp": 1}),
    "7b_16gpu_muon": (16, {"dp_shard": 16, "tp": 1}),
    "7b_16gpu_fp8": (16, {"dp_shard": 16, "tp": 1}),
    "13b_24gpu_validation": (24, {"dp_shard": 6, "tp": 4}),
    "70b_32gpu_tp4": (32, {"dp_shard": 8, "tp": 4}),
    "13b_32gpu_tp4_pp2": (32, {"dp_shard": 4, "tp": 4, "pp": 2}),
    "29b_32gpu_tp4_pp2": (32, {"dp_shard": 4, "tp": 4, "pp": 2}),
    "70b_32gpu_tp4_pp4": (32, {"dp_shard": 2, "tp": 4, "pp": 4}),
    # Mixture of Experts (moe_4b)
    "moe_8gpu": (8, {"dp_shard": 2, "tp": 4}),
    "moe_24gpu": (24, {"dp_shard": 6, "tp": 4}),
    "moe_ep_32gpu": (32, {"dp_shard": 4, "tp": 4, "ep": 2}),
    # Long context (docs/long_context.md)
    "llama3_8b_128k_32gpu": (32, {"dp_shard": 4, "cp": 8}),
    "llama3_8b_512k_64gpu": (64, {"dp_shard": 1, "cp": 32, "tp": 2}),
    # Continued pretraining from released weights (docs/models.md)
    "qwen3_8b_16gpu_continue": (16, {"dp_shard": 16, "tp": 1}),
    "qwen3_5_9b_16gpu_continue": (16, {"dp_shard": 16, "tp": 1}),
    # DeepSeek-V3 family (docs/models.md)
    "deepseek_v2_lite_16gpu_ep8": (16, {"dp_shard": 2, "ep": 8, "tp": 1}),
    # gpt-oss (docs/models.md)
    "gpt_oss_20b_16gpu_continue": (16, {"dp_shard": 2, "ep": 8, "tp": 1}),
}
# One process: smoke runs and the demo, with the heads `kiln train`'s start-up line gives.
SMALL_RECIPES = {
    "debug": "4 heads of 32",
    "demo": "6 heads of 64",
    "debug_moe": "4 heads of 32",
    "qwen3_debug": "4 heads of 48",  # Qwen3's decoupled head width (docs/models.md)
    "deepseek_v3_debug": "4 heads (queries/keys 16 + 8, values 16)",  # MLA: no one head width
    "qwen3_next_debug": "4 heads of 64",  # its full-attention layers' (docs/models.md)
}


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_checks_at_its_gpu_count(name):
    gpus, mesh = RECIPES[name]
    cfg = load_config(REPO / "configs" / "train" / f"{name}.toml", world_size=gpus)
    layout = resolve_layout(cfg.distributed, gpus)
    assert {k: layout[k] for k in mesh} == mesh


def test_every_shipped_recipe_is_checked_here():
    shipped = {path.stem for path in (REPO / "configs" / "train").glob("*.toml")}
    assert shipped == set(RECIPES) | set(SMALL_RECIPES)


@pytest.mark.parametrize("name", sorted(SMALL_RECIPES))
def test_small_recipe_checks_in_one_process(name):
    cfg = load_config(REPO / "configs" / "train" / f"{name}.toml", world_size=1)
    model = startup_summary(cfg, 1, None, 0).splitlines()[0]
    assert model.startswith(f"kiln: model {cfg.model.preset}: ") and SMALL_RECIPES[name] in model


def test_shipped_recipes_are_the_repository_configs():
    # The package's copy is the checkout's configs/ itself, not a second set of files to keep in sync.
    assert SHIPPED_CONFIGS.resolve() == (REPO / "configs").resolve()
    assert (SHIPPED_CONFIGS / "model" / "llama3_8b.toml").is_file()


@pytest.mark.parametrize("given", ["configs/train/7b.toml", "7b", "7b.toml"])
def test_missing_recipe_path_falls_back_to_the_shipped_copy(given, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert find_recipe(given) == RECIPE_DIR / "7b.toml"
    assert "shipped with kiln" in capsys.readouterr().err
    assert load_config(given, world_size=4).model.preset == "llama3_7b"


def test_a_local_file_wins_over_the_shipped_recipe(tmp_path, monkeypatch, capsys):
    local = tmp_path / "configs" / "train" / "7b.toml"
    local.parent.mkdir(parents=True)
    local.write_text("[train]\nmax_steps = 3\n")
    monkeypatch.chdir(tmp_path)
    assert find_recipe("configs/train/7b.toml") == Path("configs/train/7b.toml")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("given", ["configs/train/nope.toml", "nope", "elsewhere/7b.toml"])
def test_unknown_recipe_lists_the_shipped_ones(given, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError, match=r"config file not found: .*shipped with kiln: .*7b_12gpu_tp4"
    ):
        find_recipe(given)
