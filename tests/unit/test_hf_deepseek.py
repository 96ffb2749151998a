"""Hugging Face parity of DeepSeek-V3 (kiln/model/deepseek/hf_adapters.py): tiny random
DeepseekV3ForCausalLM models (DeepSeek-V3's shape, Kimi K2's under model_type kimi_k2, Moonlight's
and others) convert to kiln with the logits and greedy tokens of transformers, kiln models export
to folders transformers loads with the same logits, the multi-token prediction (MTP) weights
travel bitwise under their released names and compute what the released layout means, and what
kiln cannot export is refused (config.json's refusals: test_hf_deepseek_config.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kiln.checkpoint import load_checkpoint, read_model_config, resolve_checkpoint, save_checkpoint
from kiln.checkpoint.hf_convert import (
    UNMAPPED_INIT_SEED,
    hf_to_kiln,
    kiln_to_hf,
    model_config_from_hf,
)
from kiln.cli import main
from kiln.config import JobConfig, ModelConfig
from kiln.errors import KilnError
from kiln.model import build_model, materialize
from kiln.model.generate import generate
from tests.unit.test_hf_convert import _hf_greedy

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek  # noqa: E402

VOCAB = 128
# fp32 on both sides: the same function computed in another order (kiln's grouped experts and
# SDPA against transformers' per-expert loop and eager attention, rotation in half-split against
# interleaved pairs) differs by rounding alone: at most 3.4e-6 measured, on logits up to 3.7.
TOLERANCE = 1e-4

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    # Larger than the 0.02 default: attention far from uniform and routing scores far apart, so
    # a wrong rotary layout or routing rule moves the logits well past the tolerance.
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    attn_implementation="eager",
)
_YARN = dict(rope_type="yarn", original_max_position_embeddings=64, rope_theta=10000.0)
VARIANTS = {
    # DeepSeek-V3's shape: low-rank queries, 2 groups keeping 1, YaRN as released (mscale =
    # mscale_all_dim = 1: the softmax scale grows, the tables stay).
    "v3": dict(
        q_lora_rank=32,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_parameters=dict(
            _YARN, factor=4.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0
        ),
    ),
    # V2-Lite's: one full query projection, no groups, two shared experts, plain RoPE.
    "lite": dict(
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        n_shared_experts=2,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # YaRN whose tables are scaled too (mscale != mscale_all_dim), 4 groups keeping 2.
    "yarn-mscale": dict(
        q_lora_rank=32,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        norm_topk_prob=True,
        rope_parameters=dict(
            _YARN, factor=8.0, beta_fast=16, beta_slow=2, mscale=0.8, mscale_all_dim=0.5
        ),
    ),
    # Kimi K2's (its config.json says model_type kimi_k2: _MODEL_TYPES): low-rank queries, no
    # group limit, one dense block, routed_scaling_factor 2.827, YaRN with beta_fast = beta_slow
    # = 1 (the ramp shrinks to one dimension) at rope_theta 50000, no MTP module.
    "kimi": dict(
        q_lora_rank=32,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.827,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
        rope_parameters=dict(
            _YARN,
            rope_theta=50000.0,
            factor=32.0,
            beta_fast=1,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    # Moonlight-16B-A3B's: one full query projection, no group limit, two shared experts, plain
    # RoPE at theta 50000, no MTP module. Its rms_norm_eps is 1e-5; here 1e-2, so that latent
    # norms taking it (DeepSeek's code keeps them at 1e-6) would move the logits past the
    # tolerance (test_latent_norms_keep_deepseeks_eps).
    "moonlight": dict(
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        n_shared_experts=2,
        routed_scaling_factor=2.446,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
        rms_norm_eps=1e-2,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    ),
}
EACH_VARIANT = pytest.mark.parametrize("variant", list(VARIANTS))
# config.json's model_type where it is not transformers' deepseek_v3; Kimi K2's also names its
# remote code (DeepSeek-V3's modeling), which kiln does not run.
_MODEL_TYPES = {"kimi": "kimi_k2"}
KIMI_AUTO_MAP = {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
}


def _hf_config(variant: str, **overrides) -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(**{**COMMON, **VARIANTS[variant], **overrides})


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    """Norms start at one and routing biases at zero on both sides, which would hide a swapped
    norm or a dropped bias: both get random values (biases large enough to move routing)."""
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
    for name, buffer in model.named_buffers():
        if name.endswith(("e_score_correction_bias", "expert_bias")):
            buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.3)


def _tokens(batch: int = 2, seq: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(2))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _load_kiln(ckpt: Path) -> torch.nn.Module:
    step_dir = resolve_checkpoint(ckpt)
    model = materialize(build_model(read_model_config(step_dir)), device="cpu", seed=None)
    load_checkpoint(step_dir, model=model)
    return model.eval()


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module, Path]]:
    """Per variant: the folder save_pretrained wrote, the HF model, and the kiln checkpoint
    `kiln convert hf-to-kiln` made of it."""
    out = {}
    for variant in VARIANTS:
        root = tmp_path_factory.mktemp(variant)
        torch.manual_seed(0)
        model = transformers.DeepseekV3ForCausalLM(_hf_config(variant)).eval()
        _randomize(model)
        model.save_pretrained(root / "hf")
        if variant in _MODEL_TYPES:
            config = json.loads((root / "hf" / "config.json").read_text())
            config.update(model_type=_MODEL_TYPES[variant], auto_map=KIMI_AUTO_MAP)
            (root / "hf" / "config.json").write_text(json.dumps(config))
        assert main(["convert", "hf-to-kiln", str(root / "hf"), str(root / "kiln")]) == 0
        out[variant] = (root / "hf", model, root / "kiln")
    return out


@EACH_VARIANT
def test_hf_to_kiln_logits_match(converted, variant):
    _, hf_model, ckpt = converted[variant]
    model, tokens = _load_kiln(ckpt), _tokens()
    with torch.no_grad():
        expected = hf_model(tokens).logits
        assert _max_diff(model(tokens), expected) <= TOLERANCE
        # The routing biases were read and steer the routing: without them, far off.
        for name, buffer in model.named_buffers():
            if name.startswith("layers.") and name.endswith("expert_bias"):
                assert buffer.abs().sum() > 0, name
                buffer.zero_()
        assert _max_diff(model(tokens), expected) > 100 * TOLERANCE


def test_latent_norms_keep_deepseeks_eps(converted):
    """The query and key-value latent norms normalize with eps 1e-6 whatever rms_norm_eps says,
    as DeepSeek's code and transformers do: with the blocks' eps instead, other logits."""
    _, hf_model, ckpt = converted["moonlight"]
    model, tokens = _load_kiln(ckpt), _tokens()
    assert model.cfg.norm_eps == 1e-2
    for name, module in model.named_modules():
        if name.endswith(("attention.kv_norm", "attention.q_norm")):
            module.eps = model.cfg.norm_eps
    with torch.no_grad():
        assert _max_diff(model(tokens), hf_model(tokens).logits) > 100 * TOLERANCE


def test_the_rotary_layout_matters(converted):
    """The same weights under transformers' half-split rotation (rope_interleave = false) give
    other logits: the reordering of the rotary rows on import is what makes them agree."""
    _, hf_model, ckpt = converted["v3"]
    other = transformers.DeepseekV3ForCausalLM(_hf_config("v3", rope_interleave=False)).eval()
    other.load_state_dict(hf_model.state_dict())
    tokens = _tokens()
    with torch.no_grad():
        assert _max_diff(other(tokens).logits, _load_kiln(ckpt)(tokens)) > 100 * TOLERANCE


@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        ("v3", {"q_lora_rank": 32, "n_groups": 2, "route_scale": 2.5, "mscale_all_dim": 1.0}),
        ("lite", {"q_lora_rank": 0, "n_groups": 1, "route_scale": 1.0, "mscale_all_dim": 0.0}),
        (
            "yarn-mscale",
            {"q_lora_rank": 32, "n_groups": 4, "route_scale": 1.5, "mscale_all_dim": 0.5},
        ),
        ("kimi", {"q_lora_rank": 32, "n_groups": 1, "route_scale": 2.827, "mscale_all_dim": 1.0}),
        (
            "moonlight",
            {"q_lora_rank": 0, "n_groups": 1, "route_scale": 2.446, "mscale_all_dim": 0.0},
        ),
    ],
)
def test_hf_to_kiln_maps_config(converted, variant, expected):
    cfg = read_model_config(resolve_checkpoint(converted[variant][2]))
    got = {
        "q_lora_rank": cfg.mla.q_lora_rank,
        "n_groups": cfg.moe.n_groups,
        "route_scale": cfg.moe.route_scale,
        "mscale_all_dim": cfg.rope_yarn_mscale_all_dim,
    }
    assert got == expected
    depth = VARIANTS[variant].get("num_nextn_predict_layers", 1)
    assert (cfg.family, cfg.n_heads, cfg.n_kv_heads, cfg.mtp.depth) == ("deepseek_v3", 4, 4, depth)
    assert (cfg.mla.kv_lora_rank, cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim) == (16, 8, 4)
    assert (cfg.moe.router, cfg.moe.first_dense_layers, cfg.expert_hidden_dim) == ("sigmoid", 1, 16)
    plain = VARIANTS[variant]["rope_parameters"]["rope_type"] == "default"
    assert cfg.rope_scaling == ("none" if plain else "yarn")


def test_missing_mtp_weights_keep_kilns_initialization(converted, tmp_path, capsys):
    """save_pretrained writes no MTP weights though config.json declares one module: kiln's
    MTP module starts from its initialization, and the conversion says so."""
    hf_dir, _, _ = converted["v3"]
    ckpt = hf_to_kiln(hf_dir, tmp_path / "kiln")
    assert "have no tensor in" in capsys.readouterr().err
    model = _load_kiln(ckpt)
    fresh = materialize(build_model(model.cfg), device="cpu", seed=UNMAPPED_INIT_SEED)
    state = fresh.state_dict()
    mtp = [name for name in model.state_dict() if name.startswith("mtp.")]
    assert mtp and all(torch.equal(model.state_dict()[n], state[n]) for n in mtp)


@EACH_VARIANT
def test_greedy_generation_matches_hf(converted, variant):
    _, hf_model, ckpt = converted[variant]
    prompt = [5, 17, 42, 99, 120]
    expected = _hf_greedy(hf_model, prompt, 12)
    assert generate(_load_kiln(ckpt), prompt, max_new_tokens=12) == expected


@pytest.mark.parametrize("variant", ["v3", "kimi"])
def test_round_trip_writes_what_save_pretrained_wrote(converted, tmp_path, variant):
    """HF -> kiln -> HF: the same tensors, bitwise (the rotary reordering undone), plus the MTP
    layer that kiln's config holds (V3's; Kimi K2 has none). A Kimi K2 checkpoint exports as
    model_type deepseek_v3, the same model, which transformers builds natively."""
    hf_dir, _, ckpt = converted[variant]
    out = kiln_to_hf(ckpt, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    original, exported = (
        load_file(hf_dir / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    assert {name for name in exported if not name.startswith("model.layers.3.")} == original.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name


def test_fused_expert_layout_is_read(converted, tmp_path):
    """The layout of transformers 5's modules (gate_up_proj, down_proj), as a checkpoint saved
    from the state dict holds it, converts to the same kiln weights."""
    _, hf_model, ckpt = converted["v3"]
    hf_model.config.save_pretrained(tmp_path / "fused")
    state = {name: t.contiguous() for name, t in hf_model.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, tmp_path / "fused" / "model.safetensors", metadata={"format": "pt"})
    fused = _load_kiln(hf_to_kiln(tmp_path / "fused", tmp_path / "kiln")).state_dict()
    for name, tensor in _load_kiln(ckpt).state_dict().items():
        if not name.startswith("mtp."):  # initialized: no MTP weights in either folder
            assert torch.equal(tensor, fused[name]), name


def _save_kiln(tmp_path: Path, cfg: ModelConfig) -> tuple[torch.nn.Module, Path]:
    """A random kiln model of `cfg` (MTP included, norms and routing biases random) saved as a
    kiln checkpoint under tmp_path/ckpt."""
    model = materialize(build_model(cfg), device="cpu", seed=3).eval()
    _randomize(model)
    save_checkpoint(
        tmp_path / "ckpt",
        5,
        model=model,
        optimizer=None,
        config=JobConfig(model=cfg),
        train_state={},
    )
    return model, tmp_path / "ckpt"


def _kiln_cfg(variant: str, moe: dict | None = None, **changes) -> ModelConfig:
    cfg = model_config_from_hf(_hf_config(variant).to_dict())
    assert cfg.mtp.depth == VARIANTS[variant].get("num_nextn_predict_layers", 1)
    moe_cfg = dataclasses.replace(cfg.moe, **(moe or {}))
    return dataclasses.replace(cfg, init_std=0.1, moe=moe_cfg, **changes)


@EACH_VARIANT
def test_kiln_to_hf_logits_match_and_mtp_round_trips(tmp_path, variant):
    model, ckpt = _save_kiln(tmp_path, _kiln_cfg(variant))
    out = tmp_path / "hf"
    assert main(["convert", "kiln-to-hf", str(ckpt), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    depth = model.cfg.mtp.depth
    assert config["num_nextn_predict_layers"] == depth and config["rope_interleave"] is True
    # transformers loads the folder, reporting the MTP layer (model.layers.3) as unexpected.
    hf_model = transformers.DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager")
    tokens = _tokens()
    with torch.no_grad():
        assert _max_diff(hf_model.eval()(tokens).logits, model(tokens)) <= TOLERANCE
    exported = load_file(out / "model.safetensors")
    mtp_layer = {name for name in exported if name.startswith("model.layers.3.")}
    if depth:
        for name in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "shared_head.norm.weight",
            "mlp.gate.e_score_correction_bias",
        ):
            assert f"model.layers.3.{name}" in mtp_layer
        assert torch.equal(
            exported["model.layers.3.embed_tokens.weight"], model.tok_embeddings.weight
        )
        assert torch.equal(exported["model.layers.3.shared_head.head.weight"], model.output.weight)
    else:
        assert not mtp_layer
    # Back to kiln: every tensor bitwise, the MTP module's and the routing biases included.
    back = _load_kiln(hf_to_kiln(out, tmp_path / "back")).state_dict()
    state = model.state_dict()
    mtp_experts = "mtp.depths.1.block.feed_forward.experts"
    assert any(name.startswith(mtp_experts) for name in state) == bool(depth)
    for name, tensor in state.items():
        assert torch.equal(tensor, back[name]), name


def _released_mtp_logits(hf_dir: Path, hf_model, hidden: torch.Tensor, ahead: torch.Tensor):
    """Depth 1 computed from the exported tensors as their released names mean it (DeepSeek's
    inference code): head(shared_head.norm(block(eh_proj([enorm(emb); hnorm(h)]))))."""
    config, n = hf_model.config, hf_model.config.num_hidden_layers
    prefix = f"model.layers.{n}."
    weights = load_file(hf_dir / "model.safetensors")
    mtp = {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}
    block = hf_deepseek.DeepseekV3DecoderLayer(config, layer_idx=n).eval()
    state = {
        k: v for k, v in mtp.items() if k.startswith(("self_attn.", "mlp.", "input_", "post_"))
    }
    experts = range(config.n_routed_experts)
    gate_up = [
        torch.cat([state.pop(f"mlp.experts.{e}.{w}_proj.weight") for w in ("gate", "up")])
        for e in experts
    ]
    state["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    state["mlp.experts.down_proj"] = torch.stack(
        [state.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts]
    )
    block.load_state_dict(state)

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return mtp[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)

    emb = F.embedding(ahead, mtp["embed_tokens.weight"])
    x = torch.cat([norm(emb, "enorm.weight"), norm(hidden, "hnorm.weight")], -1)
    x = x @ mtp["eh_proj.weight"].T
    seq = x.shape[1]
    positions = torch.arange(seq)[None]
    causal = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    rope = hf_model.model.rotary_emb(x, positions)
    x = block(x, attention_mask=causal, position_ids=positions, position_embeddings=rope)
    return norm(x, "shared_head.norm.weight") @ mtp["shared_head.head.weight"].T


@pytest.mark.parametrize("variant", ["v3", "lite"])
def test_exported_mtp_computes_what_the_released_layout_means(tmp_path, variant):
    """kiln's MTP loss of depth 1 equals the one computed from the exported tensors by their
    released names (embedding first in eh_proj's input, shared_head.norm before the head)."""
    model, ckpt = _save_kiln(tmp_path, _kiln_cfg(variant))
    out = kiln_to_hf(ckpt, tmp_path / "hf")
    hf_model = transformers.DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager")
    tokens = _tokens()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    captured = {}
    last = model.layers[str(model.cfg.n_layers - 1)]
    handle = last.register_forward_hook(lambda module, args, output: captured.update(h=output))
    with torch.no_grad():
        model(inputs)
        handle.remove()
        block_args = {"mask": None, "context_parallel": None, "moe_scale": None}
        weighted = model.mtp(
            captured["h"],
            labels,
            embed=model.tok_embeddings,
            head=model.output,
            rope=(model.rope_cos, model.rope_sin),
            block_args=block_args,
        )
        logits = _released_mtp_logits(out, hf_model.eval(), captured["h"], labels)
    # Position i predicts t_{i+2} = labels[i+1]; the last position has no target.
    expected = F.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum"
    )
    assert torch.allclose(weighted, expected * model.cfg.mtp.loss_weight, rtol=1e-5)


def test_mtp_copies_that_differ_are_refused(tmp_path):
    _, ckpt = _save_kiln(tmp_path, _kiln_cfg("v3"))
    out = kiln_to_hf(ckpt, tmp_path / "hf")
    weights = load_file(out / "model.safetensors")
    weights["model.layers.3.shared_head.head.weight"] += 1.0
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KilnError, match=r"model\.layers\.3\.shared_head\.head\.weight differs"):
        hf_to_kiln(out, tmp_path / "back")


@pytest.mark.parametrize(
    ("moe", "changes", "message"),
    [
        ({"router": "softmax_topk"}, {}, r"moe\.router = 'softmax_topk'"),
        ({"frequency": 2}, {}, r"moe\.frequency = 2"),
    ],
)
def test_unexportable_models_are_refused(tmp_path, moe, changes, message):
    _, ckpt = _save_kiln(tmp_path, _kiln_cfg("v3", moe=moe, **changes))
    with pytest.raises(
        KilnError, match=f"cannot export this model as DeepseekV3ForCausalLM.*{message}"
    ):
        kiln_to_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
