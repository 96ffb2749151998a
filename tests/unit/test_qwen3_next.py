"""The qwen3_next family (docs/models.md): the debug recipe trains and generates through the CLI;
shapes, counts and FLOPs; packed documents computed as if each ran alone; a pipeline split gives
the whole model's logits; generation's states give the full forward's; one message per bad key."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kiln.cli import main
from kiln.config import load_config
from kiln.config.load import config_from_dict
from kiln.config.sections import ModelConfig
from kiln.errors import ConfigError
from kiln.model import count_params, flops_per_token, materialize
from kiln.model.forward_args import StageRole
from kiln.model.qwen3_next.counts import delta_rule_flops
from kiln.model.qwen3_next.delta_rule import chunk_gated_delta_rule
from kiln.model.qwen3_next.model import document_starts
from kiln.model.registry import family_of
from tests.conftest import REPO

RECIPE = REPO / "configs" / "train" / "qwen3_next_debug.toml"


def debug_config(**model) -> ModelConfig:
    """The qwen3_next_debug preset with `model` keys overridden."""
    return config_from_dict({"model": {"preset": "qwen3_next_debug", **model}}).model


def built(cfg: ModelConfig, stage: StageRole | None = None, seed: int = 0) -> torch.nn.Module:
    """The model (or a pipeline stage of it) in fp32 on the CPU, initialized from `seed`."""
    with torch.device("meta"):
        model = family_of(cfg).build(cfg, stage)
    return materialize(model, device=torch.device("cpu"), seed=seed).eval()


def test_kiln_train_runs_the_recipe_and_kiln_generate_continues(demo_data, tmp_path, capsys):
    run = tmp_path / "run"
    args = [f"--data.path={demo_data}", f"--metrics.run_dir={run}", "--data.num_workers=0"]
    steps = ["--train.max_steps=3", "--checkpoint.interval=3", "--metrics.log_interval=1"]
    assert main(["train", str(RECIPE), *args, *steps, "--metrics.plot=false"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and all(map(math.isfinite, losses))
    # The start-up summary names the kernel the linear layers run (the CPU's: torch's chunked).
    started = capsys.readouterr().out
    assert (
        "3 Gated DeltaNet layers (gated delta rule: torch kernel, short convolution: torch), "
        "1 full attention"
    ) in started
    checkpoint = run / "checkpoints" / "step_00000003"
    prompt = ["generate", str(checkpoint), "--prompt", "def main(", "--max-new-tokens", "4"]
    assert main([*prompt, "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def main(")


def test_shapes_and_counts_are_those_of_the_built_model():
    cfg = debug_config()
    model = built(cfg)
    params = dict(model.named_parameters())
    linear, full = "layers.0.linear_attention.", "layers.3.attention."
    # 2 key heads of 32, 4 value heads of 32; the convolution's taps per channel.
    assert params[f"{linear}wq.weight"].shape == (64, 128)
    assert params[f"{linear}wv.weight"].shape == params[f"{linear}wz.weight"].shape == (128, 128)
    assert params[f"{linear}wb.weight"].shape == params[f"{linear}wa.weight"].shape == (4, 128)
    assert params[f"{linear}conv_k"].shape == (64, 4) and params[f"{linear}conv_v"].shape == (
        128,
        4,
    )
    assert params[f"{linear}A_log"].shape == params[f"{linear}dt_bias"].shape == (4,)
    assert params[f"{linear}norm.weight"].shape == (32,)
    # 4 heads of 64: each head's rows of wq are its query and its output gate.
    assert params[f"{full}wq.weight"].shape == (4 * 64 * 2, 128)
    assert params[f"{full}wk.weight"].shape == (2 * 64, 128)
    assert not any(name.startswith("layers.3.linear_attention") for name in params)
    assert model(torch.randint(0, 4096, (2, 40))).shape == (2, 40, 4096)

    counts = count_params(cfg)
    assert counts.total == sum(p.numel() for p in params.values())
    routed = [p.numel() for n, p in params.items() if ".experts." in n]
    assert counts.active == counts.total - sum(routed) // 2  # top 2 of 4 experts
    tied = debug_config(tie_embeddings=True)
    assert count_params(tied).total == sum(p.numel() for p in built(tied).parameters())


def test_init_follows_the_family():
    params = dict(built(debug_config(), seed=3).named_parameters())
    a_log = torch.stack([params[f"layers.{i}.linear_attention.A_log"] for i in range(3)])
    assert ((a_log.exp() >= 1) & (a_log.exp() <= 16)).all() and a_log.unique().numel() == 12
    assert (params["layers.0.linear_attention.dt_bias"] == 1).all()
    # Zero-centred norms start at 0 (a gain of 1); the gated norm is a plain one, at 1.
    for name in ("layers.0.attention_norm", "layers.3.attention.q_norm", "norm"):
        assert (params[f"{name}.weight"] == 0).all(), name
    assert (params["layers.0.linear_attention.norm.weight"] == 1).all()


def test_flops_count_the_delta_rules_matmuls():
    cfg = debug_config()
    a, seq = cfg.linear_attention, 100  # not a multiple of the chunk: padded to 128
    heads, c, dk, dv = a.num_value_heads, a.chunk_size, a.key_head_dim, a.value_head_dim
    q, k = torch.randn(2, 2, seq, heads, dk).unbind(0)
    v, g, beta = (
        torch.randn(1, seq, heads, dv),
        -torch.rand(1, seq, heads),
        torch.rand(1, seq, heads),
    )
    with FlopCounterMode(display=False) as counter:
        chunk_gated_delta_rule(q[:1], k[:1], v, g, beta, scale=dk**-0.5, chunk_size=c)
    # The counter sees the matrix products; the triangular solve (C²·(dk + dv) per chunk) it
    # does not count, nor the convolution (2·K per channel and token).
    chunks = math.ceil(seq / c)
    solve = heads * chunks * c * c * (dk + dv)
    channels = 2 * a.num_key_heads * dk + heads * dv
    conv = 6 * a.conv_kernel * channels
    per_token = 3 * (counter.get_total_flops() + solve) // seq  # × 3 for the backward
    assert delta_rule_flops(cfg, seq) == per_token + conv
    # 6 per matmul weight, causal attention in the one full-attention layer, the delta rule and
    # the convolution in the three linear ones.
    attention = 3 * seq * cfg.n_heads * 2 * 64
    expected = 6 * count_params(cfg).matmul + attention + 3 * delta_rule_flops(cfg, seq)
    assert flops_per_token(cfg, seq) == expected


def test_packed_documents_compute_as_if_each_ran_alone():
    # Chunks of 16 tokens: documents start mid-chunk and on a chunk's first token (32).
    cfg = debug_config(linear_attention={"chunk_size": 16})
    model = built(cfg)
    bounds = [0, 7, 32, 51, 70]
    tokens = torch.randint(0, cfg.vocab_size, (2, bounds[-1]))
    ids = torch.zeros(2, bounds[-1], dtype=torch.int32)
    for doc, start in enumerate(bounds[1:-1], 1):
        ids[:, start:] = doc
    assert document_starts(ids)[0].nonzero().flatten().tolist() == bounds[:-1]
    with torch.no_grad():
        packed = model(tokens, document_ids=ids)
        alone = torch.cat([model(tokens[:, a:b]) for a, b in itertools.pairwise(bounds)], dim=1)
        unmasked = model(tokens)
    # fp32 rounding: the full-attention layer's rotary positions differ by each document's
    # offset (the scores depend on the distance alone), the rest is the same arithmetic.
    assert (packed - alone).abs().max() < 1e-5
    # Without the documents every later document sees the earlier ones.
    assert (unmasked - alone)[:, 7:].abs().max() > 1e-2


def test_a_pipeline_split_gives_the_whole_models_logits():
    cfg = debug_config()
    whole = built(cfg)
    first = built(cfg, StageRole((0, 1), first=True, last=False))
    last = built(cfg, StageRole((2, 3), first=False, last=True))
    names = {*dict(first.named_parameters()), *dict(last.named_parameters())}
    assert names == set(dict(whole.named_parameters()))
    tokens = torch.randint(0, cfg.vocab_size, (2, 48))
    ids = (torch.arange(48) >= 20).int().expand(2, 48)
    with torch.no_grad():
        expected = whole(tokens, document_ids=ids)
        got = last(first(tokens, document_ids=ids), document_ids=ids)
    # Each stage initializes its own blocks to the whole model's values and computes the same.
    assert torch.equal(got, expected)
    plan = family_of(cfg).parallel_plan(cfg)
    for block in whole.layers.values():
        for path in (*plan.block_tp(block), *plan.block_fsdp_units(block)):
            block.get_submodule(path)  # every path the plan names exists
    assert [plan.block_attention(b) for b in whole.layers.values()] == [(), (), (), ("attention",)]


def test_generation_states_give_the_full_forwards_logits():
    cfg = debug_config(linear_attention={"chunk_size": 16})
    model = built(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, 40))
    cache = model.generation_cache(batch=1, max_len=40, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :21], cache)]  # a prompt, then one token at a time
        steps += [model(tokens[:, i : i + 1], cache) for i in range(21, 40)]
    # fp32 rounding: the chunked kernel sums a chunk's contributions in another order than
    # one token's step does.
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["--model.layer_types=['linear_attention']"], "model.layer_types lists 1 layers"),
        (["--model.sliding_window=8"], "model.sliding_window: options of the llama family's"),
        (
            [
                "--model.layer_types=['sliding_attention', 'linear_attention', 'full_attention', "
                "'full_attention']"
            ],
            "family 'qwen3_next' has no sliding window",
        ),
        (["--model.linear_attention.num_value_heads=3"], "must be a multiple of num_key_heads"),
        (["--model.linear_attention.conv_kernel=0"], "linear_attention.conv_kernel must be"),
        (["--model.partial_rotary_factor=0"], "partial_rotary_factor must be in (0, 1]"),
        (["--model.partial_rotary_factor=0.3"], "turns 19 dims; RoPE turns pairs"),
        (
            ["--distributed.cp=4", "--train.seq_len=16"],
            "cuts a sequence of 16 tokens into chunks of 2, shorter than the 3 inputs",
        ),
        (
            ["--distributed.tp=4", "--model.n_heads=8", "--model.n_kv_heads=4"],
            "must divide model.linear_attention.num_key_heads (2)",
        ),
    ],
)
def test_bad_keys_are_named(overrides, named):
    world = 4 if {"--distributed.tp=4", "--distributed.cp=4"} & set(overrides) else 1
    with pytest.raises(ConfigError) as error:
        load_config(RECIPE, overrides, world_size=world)
    assert named in str(error.value) and "(1 problem)" in str(error.value)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            ["--model.layer_types=['linear_attention', 'full_attention']", "--model.n_layers=2"],
            "only family 'qwen3_next' builds",
        ),
        (["--model.attention_output_gate=true"], "model.attention_output_gate: options of the"),
    ],
)
def test_the_familys_keys_elsewhere_are_refused(overrides, named):
    with pytest.raises(ConfigError, match=named):
        load_config(REPO / "configs" / "train" / "debug.toml", overrides, world_size=1)


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [
        # Qwen: 80B total, 3B activated (3.25B without the embedding and the output head).
        ("qwen3_next_80b_a3b", 79_674_391_296, 3_874_929_408),
        ("qwen3_5_9b", 8_953_803_264, 8_953_803_264),  # Qwen: 9B
    ],
)
def test_presets_count_the_parameters_of_the_transformers_model(name, total, active):
    transformers = pytest.importorskip("transformers")
    cfg = load_config(None, [f"--model.preset='{name}'"], world_size=1).model
    a, moe = cfg.linear_attention, cfg.moe
    keys = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_hidden_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.resolved_head_dim,
        layer_types=cfg.layer_types,
        linear_conv_kernel_dim=a.conv_kernel,
        linear_key_head_dim=a.key_head_dim,
        linear_value_head_dim=a.value_head_dim,
        linear_num_key_heads=a.num_key_heads,
        linear_num_value_heads=a.num_value_heads,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    if moe.num_experts:
        keys |= dict(
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.ffn_hidden_dim,
            shared_expert_intermediate_size=moe.shared_experts * moe.ffn_hidden_dim,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        config, model_class = transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM
    else:
        config, model_class = transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM
    with torch.device("meta"):  # no memory; a tenth of a second for the 80B model
        hf = model_class(config(**keys))
    counts = count_params(cfg)
    assert counts.total == sum(p.numel() for p in hf.parameters()) == total
    assert counts.active == active
