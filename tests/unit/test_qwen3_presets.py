"""The Qwen3 presets have the released checkpoints' shapes: kiln counts exactly the parameters of
transformers' Qwen3 / Qwen3-MoE model built from the same numbers, the counts round to the sizes
Qwen publishes, and the presets validate and plan."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from kiln.cli import main
from kiln.config import ModelConfig, load_config
from kiln.model import count_params

transformers = pytest.importorskip("transformers")

# Preset -> what Qwen publishes on the model cards, in billions: total, non-embedding, and for
# the MoE models activated; each compared at the precision published (decimals).
PUBLISHED = {
    "qwen3_0_6b": {"total": (0.6, 1), "non_embedding": (0.44, 2)},
    "qwen3_1_7b": {"total": (1.7, 1), "non_embedding": (1.4, 1)},
    "qwen3_4b": {"total": (4.0, 1), "non_embedding": (3.6, 1)},
    "qwen3_8b": {"total": (8.2, 1), "non_embedding": (6.95, 2)},
    "qwen3_14b": {"total": (14.8, 1), "non_embedding": (13.2, 1)},
    "qwen3_32b": {"total": (32.8, 1), "non_embedding": (31.2, 1)},
    # Qwen says 3.3B activated, but the released config gives 3,353,032,704 active parameters:
    # embedding + head 2 · 151936 · 2048 = 622,329,856; final norm 2048; per block attention
    # 2 · 2048 · 4096 + 2 · 2048 · 512 + q/k norms 2 · 128 + 2 norms 2 · 2048 = 18,878,720,
    # router 2048 · 128 = 262,144 and 8 experts 8 · 3 · 2048 · 768 = 37,748,736; 48 blocks of
    # 56,889,600 = 2,730,700,800. 3.353B rounds to 3.4B: Qwen's 3.3B is that truncated. We
    # assert what the config gives.
    "qwen3_30b_a3b": {"total": (30.5, 1), "active": (3.4, 1), "non_embedding": (29.9, 1)},
    "qwen3_235b_a22b": {"total": (235, 0), "active": (22, 0), "non_embedding": (234, 0)},
}


def preset(name: str) -> ModelConfig:
    return load_config(None, [f"--model.preset='{name}'"], world_size=1).model


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """Qwen3Config / Qwen3MoeConfig keyword arguments for kiln's `cfg` (a Qwen3 preset's keys)."""
    kwargs: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_hidden_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.resolved_head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        use_sliding_window=False,
    )
    if cfg.moe.num_experts:
        moe = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
        kwargs.update(
            num_experts=cfg.moe.num_experts,
            num_experts_per_tok=cfg.moe.top_k,
            moe_intermediate_size=cfg.expert_hidden_dim,
            norm_topk_prob=cfg.moe.route_norm,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(cfg.n_layers) if i not in moe],
        )
    return kwargs


def hf_param_count(cfg: ModelConfig) -> int:
    """Parameters of transformers' model of `cfg`, built on the meta device (no memory; well
    under a second for the 235B model, so every preset is built whole)."""
    if cfg.moe.num_experts:
        config, model_class = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
    else:
        config, model_class = transformers.Qwen3Config, transformers.Qwen3ForCausalLM
    with torch.device("meta"):
        model = model_class(config(**hf_config_kwargs(cfg)))
    # parameters() yields a tied embedding and output head once.
    return sum(p.numel() for p in model.parameters())


def qwen_non_embedding(cfg: ModelConfig) -> int:
    """Qwen's "non-embedding" count leaves out the output head too when it is untied (kiln's
    ParamCount.non_embedding keeps it: 8B is 6.95B to Qwen, 7.57B to kiln)."""
    counts = count_params(cfg)
    return counts.total - counts.embedding - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)


@pytest.mark.parametrize("name", PUBLISHED)
def test_kiln_counts_the_parameters_of_the_transformers_model(name):
    cfg = preset(name)
    assert count_params(cfg).total == hf_param_count(cfg)


@pytest.mark.parametrize("name", PUBLISHED)
def test_counts_round_to_the_published_sizes(name):
    cfg = preset(name)
    counts = count_params(cfg)
    ours = {
        "total": counts.total,
        "active": counts.active,
        "non_embedding": qwen_non_embedding(cfg),
    }
    for key, (published, decimals) in PUBLISHED[name].items():
        assert round(ours[key] / 1e9, decimals) == published, (key, ours[key])
    if cfg.moe.num_experts == 0:
        assert counts.active == counts.total


def test_published_activated_size_of_30b_a3b_is_truncated():
    active = count_params(preset("qwen3_30b_a3b")).active
    assert active == 3_353_032_704 and math.floor(active / 1e8) / 10 == 3.3


@pytest.mark.parametrize("name", PUBLISHED)
def test_preset_validates_with_the_released_qwen3_keys(name):
    cfg = preset(name)  # load_config validates: it raises on any problem
    assert (cfg.resolved_head_dim, cfg.qk_norm, cfg.vocab_size) == (128, True, 151936)
    assert (cfg.norm_eps, cfg.rope_theta, cfg.max_seq_len) == (1e-6, 1e6, 40960)
    assert cfg.tie_embeddings == (name in ("qwen3_0_6b", "qwen3_1_7b", "qwen3_4b"))
    if cfg.moe.num_experts:
        assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.router) == (128, 8, "softmax_topk")
        assert cfg.moe.route_norm and all(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
        # router_aux_loss_coef 0.001 over all blocks at once, top_k times kiln's per-block loss.
        assert cfg.moe.aux_loss_weight == pytest.approx(0.001 * 8 / cfg.n_layers, rel=1e-5)


@pytest.mark.parametrize(("name", "gpus"), [("qwen3_8b", 8), ("qwen3_30b_a3b", 16)])
def test_kiln_plan_finds_a_layout(name, gpus, capsys):
    args = ["plan", "--model", name, "--gpus", str(gpus), "--gpu", "h100", "--seq-len", "4096"]
    assert main([*args, "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert f"kiln plan: {name} on {gpus} × H100 SXM" in out
    assert "why #1:" in out and "is the fastest layout that fits" in out
