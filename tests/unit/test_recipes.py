"""The seeds' recipes exist with their meshes and pass validation at their GPU counts."""

import pytest

from kiln.config import load_config, resolve_layout
from tests.conftest import REPO

RECIPES = {
    "7b": (4, {"dp_shard": 4, "tp": 1}),
    "7b_12gpu_tp4": (12, {"dp_shard": 3, "tp": 4}),
    "7b_32gpu_fsdp": (32, {"dp_shard": 32, "tp": 1}),
    "13b_24gpu_validation": (24, {"dp_shard": 6, "tp": 4}),
    "70b_32gpu_tp4": (32, {"dp_shard": 8, "tp": 4}),
    "13b_32gpu_tp4_pp2": (32, {"dp_shard": 4, "tp": 4, "pp": 2}),
    "29b_32gpu_tp4_pp2": (32, {"dp_shard": 4, "tp": 4, "pp": 2}),
    "70b_32gpu_tp4_pp4": (32, {"dp_shard": 2, "tp": 4, "pp": 4}),
}


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_checks_at_its_gpu_count(name):
    gpus, mesh = RECIPES[name]
    cfg = load_config(REPO / "configs" / "train" / f"{name}.toml", world_size=gpus)
    layout = resolve_layout(cfg.distributed, gpus)
    assert {k: layout[k] for k in mesh} == mesh
