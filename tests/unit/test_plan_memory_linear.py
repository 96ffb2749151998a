"""The planner's memory terms for blocks whose token mixer is a linear recurrence (the qwen3_next
family's Gated DeltaNet layers, `LinearMixerTerms`): what the layer keeps around its kernel,
measured with saved-tensor hooks, and how the planner sums hybrid stacks (what fla-core's
kernel keeps is measured on CUDA: tests/gpu/test_delta_rule_fla.py)."""

from __future__ import annotations

import pytest
import torch

from kiln.config import JobConfig
from kiln.config.load import config_from_dict
from kiln.model.qwen3_next import gated_deltanet
from kiln.model.qwen3_next.counts import (
    fla_kernel_bytes,
    gated_deltanet_bytes_around_kernel,
    linear_attention_params,
)
from kiln.parallel.pipeline_split import in_flight_microbatches
from kiln.plan.activations import (
    activation_bytes,
    attention_bytes_per_token,
    ffn_bytes_per_token,
    layer_bytes_per_token,
    linear_mixer_bytes_per_token,
)
from kiln.plan.memory import largest_unit_params
from tests.support.saved_tensors import saved_bytes

ONE = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}


def hybrid(**model) -> JobConfig:
    """The debug Qwen3-Next (3 linear, 1 full layer, MoE) at 2 × 1,024 tokens."""
    cfg = config_from_dict({"model": {"preset": "qwen3_next_debug", **model}})
    cfg.train.seq_len, cfg.train.batch_size = 1024, 2
    return cfg


def saved_around_kernel(layer: torch.nn.Module, batch: int, seq: int, dim: int, monkeypatch) -> int:
    """Bytes of the distinct tensors a bf16 Gated DeltaNet's forward saves outside its kernel
    (whose saves are the kernel's own: fla's on CUDA), its weights and input excluded."""
    in_kernel = [False]
    kernel = gated_deltanet.gated_delta_rule

    def marked_kernel(*args, **kwargs):
        in_kernel[0] = True
        try:
            return kernel(*args, **kwargs)
        finally:
            in_kernel[0] = False

    monkeypatch.setattr(gated_deltanet, "gated_delta_rule", marked_kernel)
    x = torch.randn(batch, seq, dim, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return saved_bytes(
            lambda: layer(x), skip=[*layer.parameters(), x], counting=lambda: not in_kernel[0]
        )


@pytest.mark.parametrize(
    "linear_attention",
    [
        {},  # the debug preset: 2 key heads of 32, 4 value heads of 32
        {"num_key_heads": 2, "num_value_heads": 6, "key_head_dim": 16, "value_head_dim": 48},
    ],
)
def test_gated_deltanet_keeps_what_the_planner_counts_around_its_kernel(
    linear_attention, monkeypatch
):
    cfg = hybrid(linear_attention=linear_attention).model
    torch.manual_seed(0)
    layer = gated_deltanet.GatedDeltaNet(cfg)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.05)
    layer = layer.to(torch.bfloat16)  # FSDP's compute dtype
    # The difference between two token counts leaves what grows with the tokens.
    more, fewer = (saved_around_kernel(layer, b, 64, cfg.dim, monkeypatch) for b in (4, 2))
    assert (more - fewer) / 128 == gated_deltanet_bytes_around_kernel(cfg)


def test_hybrid_stack_sums_each_blocks_own_mixer():
    """Three Gated DeltaNet blocks and one attention block, each with its MoE feed-forward:
    without checkpointing all four are kept; under full AC the block recomputed is the
    biggest kind (here a Gated DeltaNet's: it keeps more per token than the attention)."""
    cfg = hybrid()
    m = cfg.model
    a = m.linear_attention
    mixer = gated_deltanet_bytes_around_kernel(m) + fla_kernel_bytes(m)
    norm_and_input = 2 * m.dim + 4 + 2 * m.dim
    assert linear_mixer_bytes_per_token(m) == norm_and_input + mixer
    # tp splits the mixer's heads and, under sequence parallel, its norm's input.
    assert linear_mixer_bytes_per_token(m, 2) == (2 * m.dim + 4) / 2 + 2 * m.dim + mixer / 2
    linear = layer_bytes_per_token(m, moe=True, linear=True)
    full = layer_bytes_per_token(m, moe=True)
    assert linear == linear_mixer_bytes_per_token(m) + ffn_bytes_per_token(m, moe=True)
    assert full == attention_bytes_per_token(m) + ffn_bytes_per_token(m, moe=True)
    assert linear > full
    tokens = 2 * 1024
    assert activation_bytes(cfg, ONE).kept == tokens * (3 * linear + full)
    cfg.train.activation_checkpointing = "full"
    checkpointed = activation_bytes(cfg, ONE)
    assert checkpointed.kept == tokens * 4 * 2 * m.dim
    assert checkpointed.recompute > tokens * linear > tokens * full
    # An FSDP unit: the Gated DeltaNet's weights, when larger than the attention's and experts'.
    wide = hybrid(linear_attention={"num_value_heads": 8, "value_head_dim": 64}).model
    assert largest_unit_params(wide, ONE) == sum(linear_attention_params(wide))
    assert a.num_value_heads == 4  # the preset the sums above were worked for


def test_pipeline_stage_holds_the_biggest_mixers_first():
    """pp=2 splits the four blocks two and two; the worst case a stage is planned for holds two
    Gated DeltaNet blocks (the model has three), not one of each."""
    cfg = hybrid()
    cfg.distributed.pp, cfg.distributed.pp_microbatches = 2, 2
    m = cfg.model
    linear = layer_bytes_per_token(m, moe=True, linear=True)
    per_micro_batch = 1024 * 2 * linear  # one sequence of 1,024 tokens a micro-batch
    in_flight = in_flight_microbatches(cfg.distributed, 2)
    assert activation_bytes(cfg, {**ONE, "pp": 2}).kept == in_flight * per_micro_batch
