"""The DeepSeek-V3 family's counts (kiln/model/deepseek/counts.py): the published sizes of its
presets, FLOPs per token against the built model's weights and a FLOP counter, multi-head latent
attention's terms, and `kiln plan` for the 671B model with MLA and MTP in its terms."""

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from kiln.cli import main
from kiln.config import JobConfig, ModelConfig, load_config
from kiln.model import build_model, count_params, flops_per_token, materialize
from kiln.model.forward_args import LossScale
from kiln.model.moe.experts import GroupedExperts
from kiln.model.registry import family_of
from kiln.plan import search as plan_search
from kiln.plan.activations import (
    activation_bytes,
    cp_exchange_bytes,
    cp_held_bytes,
    gathered_kv_bytes,
    layer_bytes_per_token,
    logit_bytes,
)
from kiln.plan.hardware import find_gpu, make_cluster
from kiln.plan.memory import estimate_memory, root_unit_params
from kiln.plan.throughput import ring_recompute_flops, step_time

ONE = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}


def preset(name: str, *overrides: str) -> ModelConfig:
    return load_config(None, [f"--model.preset='{name}'", *overrides], world_size=1).model


def without_mtp(m: ModelConfig) -> ModelConfig:
    return replace(m, mtp=replace(m.mtp, depth=0))


def test_671b_has_the_published_total_and_active_counts():
    """DeepSeek: 671B total, 37B activated, for the main model; 685B with the MTP module, which
    the released checkpoint stores with its own copy of the embedding and the output head."""
    m = preset("deepseek_v3_671b")
    main_model = count_params(without_mtp(m))
    assert main_model.total == 671_026_404_352
    assert main_model.total == pytest.approx(671e9, rel=0.005)
    # 37.55B: "37B" is cut off, not rounded (as Mixtral's 12.9B and Qwen's 3.3B are).
    assert main_model.active == 37_552_282_624 and int(main_model.active / 1e9) == 37
    # Training runs the MTP module: kiln's total counts it, sharing the embedding and head.
    with_mtp = count_params(m)
    assert m.mtp.depth == 1 and with_mtp.total == 682_636_472_320
    released = with_mtp.total + 2 * m.vocab_size * m.dim
    assert released == pytest.approx(685e9, rel=0.005)
    # The MTP block is an MoE block (numbered 61): it adds 8 of its 256 experts to the active.
    assert m.is_moe_layer(m.n_layers) and with_mtp.active - main_model.active == 688_100_352


def test_671b_counts_term_by_term():
    m = preset("deepseek_v3_671b")
    d, heads, vocab = 7168, 128, 129280
    attention = (
        d * 1536 + 1536 + 1536 * heads * (128 + 64)  # wq_a, q_norm, wq_b
        + d * (512 + 64) + 512 + 512 * heads * (128 + 128)  # wkv_a, kv_norm, wkv_b
        + heads * 128 * d  # wo
    )  # fmt: skip
    expert = 3 * d * 2048
    moe_all, moe_used = d * 256 + 257 * expert, d * 256 + 9 * expert
    dense = 3 * d * 18432
    blocks = 61 * (attention + 2 * d) + 3 * dense
    total = 2 * vocab * d + d + blocks + 58 * moe_all
    counts = count_params(without_mtp(m))
    assert family_of(m).attention_terms(m).params == attention == 187_107_328
    assert counts.total == total and counts.embedding == vocab * d
    assert counts.active == total - 58 * (moe_all - moe_used)


def test_v2_lite_has_the_published_total_and_active_counts():
    """DeepSeek: 15.7B total, 2.4B activated. kiln's active counts the embedding table whole
    (2.66B); without it, 2.45B, which DeepSeek's 2.4B is cut off from."""
    m = preset("deepseek_v2_lite")
    counts = count_params(m)
    assert (m.mla.q_lora_rank, m.mtp.depth, m.moe.router) == (0, 0, "softmax_topk")
    assert counts.total == 15_706_484_224
    assert counts.total == pytest.approx(15.7e9, rel=0.005)
    assert counts.active == 2_661_150_208
    assert int((counts.active - counts.embedding) / 1e8) == 24


@pytest.mark.parametrize("name", ["deepseek_v3_debug", "deepseek_v2_lite", "deepseek_v3_671b"])
def test_count_equals_the_built_model(name):
    m = preset(name)
    assert count_params(m).total == sum(p.numel() for p in build_model(m).parameters())


def _flops_by_walking_the_weights(m: ModelConfig, seq_len: int) -> int:
    """6 per weight of every matrix a token goes through: each 2-D weight once but the embedding
    (a lookup) and the output head (once per prediction: the model's and each MTP depth's);
    the 3-D routed experts top_k / num_experts of them. Plus causal attention per block."""
    weights = 0
    for name, p in build_model(m).named_parameters():
        if p.ndim == 3:
            assert ".experts." in name
            weights += p.numel() * m.moe.top_k // m.moe.num_experts
        elif name == "output.weight":
            weights += p.numel() * (1 + m.mtp.depth)
        elif p.ndim == 2 and name != "tok_embeddings.weight":
            weights += p.numel()
    # Per token and block: q·k over heads of nope + rope, the weights times v over heads of v,
    # 2 FLOPs a multiply-add, forward and backward (3×), half of the keys (causal).
    qk = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim
    attention = 3 * seq_len * m.n_heads * (qk + m.mla.v_head_dim)
    return 6 * weights + (m.n_layers + m.mtp.depth) * attention


@pytest.mark.parametrize("seq_len", [64, 4096])
def test_debug_flops_per_token_equal_a_walk_of_the_built_model(seq_len):
    m = preset("deepseek_v3_debug")
    assert m.mtp.depth == 1 and m.mla.q_lora_rank > 0
    assert flops_per_token(m, seq_len) == _flops_by_walking_the_weights(m, seq_len)
    no_mtp = without_mtp(m)
    assert flops_per_token(no_mtp, seq_len) == _flops_by_walking_the_weights(no_mtp, seq_len)


def test_debug_flops_per_token_equal_what_a_training_step_runs():
    """torch's FLOP counter over one forward and backward (MTP on, routed experts as one mm
    per expert): every matmul is 6 × tokens × the weights counted; attention, counted in full
    (no causal mask) by the counter's bmm, is twice kiln's causal half."""
    m = preset("deepseek_v3_debug")
    model = materialize(build_model(m), device="cpu", seed=0)
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.use_grouped_mm = False  # torch._grouped_mm is not counted
    batch, seq = 2, 64
    tokens = torch.randint(0, m.vocab_size, (batch, seq))
    labels = torch.randint(0, m.vocab_size, (batch, seq))
    counter = FlopCounterMode(display=False)
    with counter:
        logits = model(tokens, labels=labels, loss_scale=LossScale(1.0))
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    matmuls = counts.pop("aten.mm") + counts.pop("aten.addmm", 0)
    attention = counts.pop("aten.bmm")
    assert counts == {}
    assert matmuls == 6 * batch * seq * count_params(m).matmul
    assert matmuls + attention // 2 == batch * seq * flops_per_token(m, seq)


def test_mla_attention_terms_for_the_671b_shape():
    m = preset("deepseek_v3_671b")
    a = family_of(m).attention_terms(m)
    assert (a.kind, a.heads, a.cached_width) == ("mla", 128, 512 + 64)
    assert (a.query_width, a.key_width, a.value_width, a.output_width) == (
        128 * 192,
        128 * 192,
        128 * 128,
        128 * 128,
    )
    assert (a.latent_width, a.latent_norms) == (1536 + 512, 2)
    assert a.replicated_params == 7168 * 1536 + 1536 + 7168 * 576 + 512
    lite = preset("deepseek_v2_lite")
    b = family_of(lite).attention_terms(lite)
    assert (b.latent_width, b.latent_norms, b.cached_width) == (512, 1, 576)
    assert b.replicated_params == 2048 * 576 + 512


def test_mtp_and_mla_enter_the_planners_memory_and_flops_terms():
    """The same layout with and without MTP: its depth, checkpointed under full AC like a block
    (it keeps its input embedding and the head's input) and whole without AC (its block, the
    norms and projection around it), one more set of fp32 log-probabilities, its weights in an
    FSDP unit of its own (not the root's), and its FLOPs; context parallel gathers MLA's
    expanded keys and values (heads × (nope + rope + v)), split over tp."""
    cfg = JobConfig(model=preset("deepseek_v3_671b"))
    cfg.train.seq_len, cfg.train.batch_size, cfg.train.activation_checkpointing = 4096, 1, "full"
    m, d, tokens, vocab = cfg.model, 7168, 4096, 129280
    layout = {**ONE, "dp_shard": 128, "ep": 8}
    off = replace(cfg, model=without_mtp(m))
    on_kept, off_kept = activation_bytes(cfg, layout).kept, activation_bytes(off, layout).kept
    assert on_kept - off_kept == (2 * d + 2 * d) * tokens
    for job in (cfg, off):
        job.train.activation_checkpointing = "none"
    on_kept, off_kept = activation_bytes(cfg, layout).kept, activation_bytes(off, layout).kept
    assert on_kept - off_kept == (layer_bytes_per_token(m, moe=True) + 10 * d + 12) * tokens
    assert logit_bytes(cfg, layout) - logit_bytes(off, layout) == 4 * tokens * vocab
    assert root_unit_params(m, layout) == root_unit_params(off.model, layout)
    on_memory, off_memory = estimate_memory(cfg, layout), estimate_memory(off, layout)
    assert on_memory.weights > off_memory.weights  # the MTP block's experts and proj
    cluster = _cluster()
    on_step, off_step = step_time(cfg, layout, cluster), step_time(off, layout, cluster)
    assert on_step.flops_per_token == flops_per_token(m, 4096) > off_step.flops_per_token
    cp = {**ONE, "cp": 2, "tp": 8}
    assert gathered_kv_bytes(cfg, cp) == 2 * 4096 * 128 * (192 + 128) / 8
    # The ring passes the same keys and values, a block of half the tokens at cp = 2: one send
    # forward; backward one more and 2 of its fp32 gradient. It keeps a second bf16 copy of its
    # output (128 heads × 128 values over tp), and its backward runs attention's forward again:
    # every block's, 61 and MTP's, over nope + rope = 192 and 128 values.
    cfg.distributed.cp_mode = "ring"
    block = 2 * 2048 * 128 * (192 + 128) / 8
    assert cp_exchange_bytes(cfg, cp) == block
    assert cp_exchange_bytes(cfg, cp, backward=True) == block + 2 * 2 * block
    assert cp_held_bytes(cfg, cp) == 2 * 2048 * 128 * 128 / 8
    assert ring_recompute_flops(cfg, cp) == 62 * 4096 * 128 * (192 + 128)


def _cluster(gpus: int = 1024):
    return make_cluster(find_gpu("h100"), gpus, 8, None)


def _few_layouts(gpus: int, *, moe_experts: int = 0) -> list[dict[str, int]]:
    """The planner's layouts without context parallel or HSDP replicas and with tp of 1 or 8:
    the full search (thousands of layouts, each validated) takes minutes on two cores."""
    return [
        d
        for d in FACTORIZATIONS(gpus, moe_experts=moe_experts)
        if d["cp"] == 1 and d["dp_replicate"] == 1 and d["tp"] in (1, 8)
    ]


FACTORIZATIONS = plan_search.factorizations


def _plan(monkeypatch, capsys, model: str, gpus: int) -> dict:
    monkeypatch.setattr(plan_search, "factorizations", _few_layouts)
    args = ["plan", "--model", model, "--gpus", str(gpus), "--gpu", "h100", "--json", "--top", "3"]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("gpus", [1024, 2048])
def test_plan_answers_for_671b_as_released(gpus, monkeypatch, capsys):
    report = _plan(monkeypatch, capsys, "deepseek_v3_671b", gpus)
    best = report["top"][0]
    assert report["fitting"] > 0 and best["fits"] and best["memory_reserved_gb"] < 78
    # 256 experts of 2048 in 58 blocks: no layout fits without expert parallel.
    assert all(c["layout"]["ep"] > 1 for c in report["top"])
    assert 0.05 < best["mfu"] < 0.6
