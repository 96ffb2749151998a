"""The MoE model presets: they validate, have the published sizes, and their FLOPs per token (so
MFU) count only the parameters a token uses."""

from dataclasses import replace

import pytest

from kiln.cli import main
from kiln.config import JobConfig, ModelConfig, MoEConfig, load_config
from kiln.model import count_params, flops_per_token
from tests.conftest import REPO

# Preset -> (total, active) parameters in billions, to 0.01B: the published sizes where the
# preset is the published shape (Mixtral 46.7B / 12.9B, DeepSeekMoE-16B 16.4B / 2.8B; Qwen3-30B-A3B
# 30.5B / 3.3B and Qwen3-235B-A22B 235B / 22B: tests/unit/test_qwen3_presets.py).
SIZES = {
    "debug_moe": (0.0017, 0.0014),
    "mixtral_8x7b": (46.70, 12.88),
    "moe_4b": (4.40, 1.68),
    "deepseek_moe_16b_like": (16.38, 2.83),
    "qwen3_30b_a3b": (30.53, 3.35),
    "qwen3_235b_a22b": (235.09, 22.19),
}


def preset(name: str) -> JobConfig:
    return load_config(None, [f"--model.preset='{name}'"], world_size=1)


@pytest.mark.parametrize("name", SIZES)
def test_preset_validates_with_its_size(name):
    counts = count_params(preset(name).model)
    total, active = SIZES[name]
    assert counts.total / 1e9 == pytest.approx(total, abs=0.005 if total > 1 else 1e-4)
    assert counts.active / 1e9 == pytest.approx(active, abs=0.005 if total > 1 else 1e-4)


def test_fine_grained_preset_routes_like_deepseek_v3():
    m = preset("deepseek_moe_16b_like").model
    assert (m.moe.router, m.moe.route_norm, m.moe.bias_update_rate > 0) == ("sigmoid", True, True)
    assert m.moe.topk_groups < m.moe.n_groups and m.moe.shared_experts == 2
    assert [m.is_moe_layer(i) for i in range(3)] == [False, True, True]


def test_qwen3_30b_a3b_preset_has_the_released_head_and_kv_shape():
    # 32 query heads of 128 on dim 2048 (queries twice as wide as the model), 4 KV heads.
    m = preset("qwen3_30b_a3b").model
    assert (m.n_heads, m.resolved_head_dim, m.n_kv_heads, m.qk_norm) == (32, 128, 4, True)
    assert (m.n_heads * m.resolved_head_dim, m.n_kv_heads * m.resolved_head_dim) == (4096, 512)


def test_moe_flops_per_token_equal_a_dense_model_with_the_same_active_parameters():
    # 6 experts of width 16, top 2: a token goes through the router (dim × 6) and 2 experts
    # (2 × 3 × dim × 16); a dense SwiGLU of width 2 × 16 + 6 / 3 = 34 has as many weights.
    moe = ModelConfig(
        dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=100, ffn_hidden_dim=34,
        moe=MoEConfig(num_experts=6, top_k=2, ffn_hidden_dim=16),
    )  # fmt: skip
    dense = replace(moe, moe=MoEConfig())
    assert count_params(moe).active == count_params(dense).total < count_params(moe).total
    for seq_len in (16, 4096):
        assert flops_per_token(moe, seq_len) == flops_per_token(dense, seq_len)


def test_mixtral_flops_per_token_count_two_of_eight_experts():
    m = preset("mixtral_8x7b").model
    counts = count_params(m)
    attention = 6 * m.n_layers * 4096 * m.n_heads * m.resolved_head_dim
    norms = (2 * m.n_layers + 1) * m.dim
    # 6 × the active parameters but the embedding (a lookup) and the norm weights, + attention.
    assert flops_per_token(m, 4096) == 6 * (counts.active - counts.embedding - norms) + attention


def test_kiln_check_prints_total_and_active_parameters_and_moe_memory(capsys):
    recipe = REPO / "configs" / "train" / "debug_moe.toml"
    assert main(["check", str(recipe), "--config-only"]) == 0
    out = capsys.readouterr().out
    assert "# parameters: 1,738,368 " in out
    assert "# active parameters per token: 1,443,456 (top-2 experts)" in out
    assert "(fp32 weights, grads, AdamW of all 8 experts)" in out
    assert "(top-2 experts, activation_checkpointing = 'none')" in out
