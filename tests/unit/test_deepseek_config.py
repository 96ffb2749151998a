"""Bad DeepSeek-V3 input gets one clear message naming what is wrong (kiln/config/
validate_deepseek.py), and the presets load."""

from __future__ import annotations

import pytest

from kiln.config import load_config
from kiln.errors import ConfigError
from tests.conftest import DEBUG_CONFIG

DEEPSEEK = "--model.preset=deepseek_v3_debug"


def problems(*overrides: str, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(DEBUG_CONFIG, [DEEPSEEK, *overrides], world_size=world_size)
    return str(error.value)


def test_the_debug_preset_loads_with_mtp():
    cfg = load_config(DEBUG_CONFIG, [DEEPSEEK])
    assert cfg.model.family == "deepseek_v3" and cfg.model.mtp.depth == 1


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["--model.mla.qk_rope_head_dim=7"], "model.mla.qk_rope_head_dim (7) must be even"),
        (["--model.mla.kv_lora_rank=0"], "model.mla.kv_lora_rank must be positive"),
        (["--model.mla.kv_lora_rank=256"], "model.mla.kv_lora_rank (256) must be below"),
        (["--model.mla.q_lora_rank=128"], "model.mla.q_lora_rank (128) must be below"),
        (["--model.n_kv_heads=2"], "must equal model.n_heads"),
        (["--model.tie_embeddings=true"], "model.tie_embeddings and model.qk_norm"),
        (["--model.rope_scaling=yarn", "--model.rope_yarn_beta_slow=64"], "0 < beta_slow"),
    ],
)
def test_shapes_that_do_not_fit_are_named(overrides, named):
    assert named in problems(*overrides)


@pytest.mark.parametrize("dim", ["tp", "cp", "ep"])
def test_mtp_loads_with_every_layout(dim):
    # Multi-token prediction's depths are blocks to every parallelism (kiln/model/deepseek/plan.py).
    cfg = load_config(DEBUG_CONFIG, [DEEPSEEK, f"--distributed.{dim}=2"], world_size=2)
    assert cfg.model.mtp.depth == 1


def test_tp_that_does_not_divide_the_heads_is_refused():
    message = problems("--distributed.tp=3", world_size=3)
    assert "distributed.tp (3) must divide model.n_heads (4)" in message


def test_mtp_outside_its_family_is_refused():
    with pytest.raises(ConfigError, match="multi-token prediction belongs to family"):
        load_config(DEBUG_CONFIG, ["--model.mtp.depth=1"], world_size=1)
