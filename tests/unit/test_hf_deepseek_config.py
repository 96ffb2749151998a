"""DeepSeek-V3-architecture config.json files as released (DeepSeek's, Kimi K2's under model_type
kimi_k2) read into kiln's keys, and what kiln does not compute refused from config.json alone,
naming the key (kiln/model/deepseek/hf_deepseek.py). The models themselves are checked against
transformers in test_hf_deepseek.py."""

from __future__ import annotations

import json

import pytest

from kiln.checkpoint.hf_convert import hf_to_kiln, model_config_from_hf
from kiln.errors import ConfigError, KilnError
from tests.unit.test_hf_deepseek import COMMON, KIMI_AUTO_MAP


def _released_config() -> dict:
    """DeepSeek-V3's config.json as released (transformers 4 spelling, DeepSeek's own keys),
    shrunk to the tiny shape, without its fp8 quantization_config."""
    return {
        **{k: v for k, v in COMMON.items() if k != "attn_implementation"},
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "q_lora_rank": 32,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "aux_loss_alpha": 0.001,
        "ep_size": 1,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
    }


def _released_kimi_k2_config() -> dict:
    """Kimi K2's config.json as released (DeepSeek-V3's keys under model_type kimi_k2, its
    remote code named in auto_map), shrunk to the tiny shape, without its fp8
    quantization_config."""
    return {
        **_released_config(),
        "model_type": "kimi_k2",
        "auto_map": KIMI_AUTO_MAP,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,
        "num_nextn_predict_layers": 0,
        "pretraining_tp": 1,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
    }


def test_released_config_is_read():
    kimi = model_config_from_hf(_released_kimi_k2_config())
    assert (kimi.family, kimi.mtp.depth, kimi.moe.n_groups, kimi.moe.route_scale) == (
        "deepseek_v3",
        0,
        1,
        2.827,
    )
    assert (kimi.rope_theta, kimi.rope_scaling_factor, kimi.rope_yarn_beta_fast) == (
        50000.0,
        32.0,
        1.0,
    )
    cfg = model_config_from_hf(_released_config())
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_max_seq_len) == (
        "yarn",
        40.0,
        4096,
    )
    assert (cfg.rope_theta, cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim) == (
        10000.0,
        1.0,
        1.0,
    )
    assert (cfg.mla.q_lora_rank, cfg.mtp.depth, cfg.moe.topk_groups, cfg.norm_eps) == (
        32,
        1,
        1,
        1e-6,
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"topk_method": "greedy"}, "topk_method = 'greedy'"),
        ({"scoring_func": "softmax"}, "scoring_func = 'softmax'"),
        ({"moe_layer_freq": 2}, "moe_layer_freq = 2"),
        ({"rope_interleave": False}, "rope_interleave = False"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE scaling 'linear'"),
        ({"num_key_value_heads": 2}, "num_key_value_heads = 2"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config ('fp8'"),
        # Kimi K2 Thinking's int4 experts.
        (
            {
                "model_type": "kimi_k2",
                "quantization_config": {"quant_method": "compressed-tensors"},
            },
            "quantization_config ('compressed-tensors'",
        ),
        ({"model_type": "kimi_k2", "scoring_func": "softmax"}, "scoring_func = 'softmax'"),
    ],
)
def test_unmodeled_fields_are_refused(tmp_path, change, field):
    """Refused from config.json alone, before any weight is read, naming the field."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**_released_config(), **change}))
    with pytest.raises(ConfigError, match="cannot convert this DeepSeek-V3 variant") as e:
        hf_to_kiln(tmp_path / "hf", tmp_path / "out")
    assert field in str(e.value)
    assert not (tmp_path / "out").exists()


def test_kimi_k25_is_refused_by_its_model_type(tmp_path):
    """Kimi K2.5 nests Kimi K2's text model in a vision-language architecture of its own:
    refused before anything is read, naming what kiln converts."""
    (tmp_path / "hf").mkdir()
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": _released_kimi_k2_config(),
    }
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        KilnError, match=r"model_type 'kimi_k25'.*DeepseekV3ForCausalLM \('kimi_k2'\)"
    ):
        hf_to_kiln(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
