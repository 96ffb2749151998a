"""The planner's memory terms (kiln/plan/), each on a hand-computed case: checkpointing, sharding,
each optimizer's state, logits, FSDP's gathered units (MoE's terms: test_plan_memory_moe.py).
The activation terms are held to what kiln's blocks save, measured with saved-tensor hooks."""

from dataclasses import replace

import pytest

from kiln.config import JobConfig, ModelConfig, MoEConfig
from kiln.config.sections import OptimizerConfig
from kiln.model import build_model, count_params
from kiln.model.registry import family_of
from kiln.plan.activations import (
    LOGIT_BYTES,
    Implementation,
    activation_bytes,
    backward_transient_bytes_per_token,
    cp_exchange_bytes,
    cp_held_bytes,
    gathered_kv_bytes,
    layer_bytes_per_token,
    logit_bytes,
)
from kiln.plan.memory import (
    ALLOCATOR_OVERHEAD,
    CONTEXT_BYTES,
    MemoryEstimate,
    estimate_memory,
    fits,
    gathered_unit_bytes,
    largest_unit_params,
    peak_bytes,
    root_unit_params,
)
from kiln.plan.model_state import (
    model_state_bytes,
    muon_matrix_params,
)
from kiln.train.muon import Muon
from kiln.train.optimizer import build_optimizer

ONE = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
OPTIMIZER_NAMES = ("adamw", "muon", "lion", "schedule_free_adamw")


def job(ac: str) -> JobConfig:
    cfg = JobConfig(
        model=ModelConfig(
            dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=1000, ffn_hidden_dim=1024
        )
    )
    cfg.train.seq_len, cfg.train.batch_size, cfg.train.activation_checkpointing = 1024, 2, ac
    return cfg


# Per token, dim 512, hidden 1024, 8 heads of 64, 8 kv heads (kv_dim 512), bf16: attention keeps
# its norm's input (1024 + rstd 4), the normalized input (1024), q (1024), k and v (1024 each),
# its output (1024) and a log-sum-exp per head (32); the feed-forward its norm's input (1028),
# the normalized input (1024) and four hidden rows (4 × 2048).
LAYER = 1028 + 1024 + 1024 + 2048 + 1024 + 32 + 1028 + 1024 + 8192
# The backward's gradients: three hidden rows and the normalized input's.
TRANSIENT = 3 * 2048 + 1024


def test_layer_bytes_are_counted_term_by_term():
    cfg = job("none")
    assert layer_bytes_per_token(cfg.model, moe=False) == LAYER == 16424
    assert backward_transient_bytes_per_token(cfg.model) == TRANSIENT
    # tp=4 with sequence parallel: all but the two gathered normalized inputs split; without
    # sequence parallel the norms' inputs stay whole too.
    gathered = 2 * 1024
    assert layer_bytes_per_token(cfg.model, moe=False, tp=4) == (LAYER - gathered) / 4 + gathered
    norms = 2 * 1028
    no_sp = layer_bytes_per_token(cfg.model, moe=False, tp=4, sp=False)
    assert no_sp == (LAYER - gathered - norms) / 4 + gathered + norms


def test_activation_checkpointing_trades_memory_in_order():
    none, selective, full = (activation_bytes(job(ac), ONE) for ac in ("none", "selective", "full"))
    assert full.total < selective.total < none.total
    tokens = 2048
    assert none.kept == 8 * LAYER * tokens and none.recompute == TRANSIENT * tokens
    # full: every block keeps its bf16 input; one is recomputed with its backward's gradients.
    assert full.kept == 8 * 2 * 512 * tokens
    assert full.recompute == (LAYER + TRANSIENT) * tokens
    # selective: blocks 0, 2, 4, 6 checkpointed, the other four whole.
    assert selective.kept == (4 * 2 * 512 + 4 * LAYER) * tokens
    estimate = estimate_memory(job("full"), ONE)
    assert (estimate.activations, estimate.recompute) == (full.kept, full.recompute)


def test_logits_are_fp32_with_their_gradients_split_by_vocabulary_under_loss_parallel():
    cfg = job("none")
    assert LOGIT_BYTES == 12  # log-probs kept (4), their gradient (4), the logits' gradient (4)
    assert logit_bytes(cfg, ONE) == 12 * 2048 * 1000
    tp4 = {**ONE, "tp": 4}
    assert logit_bytes(cfg, tp4) == 12 * 2048 * 250  # every token, a quarter of the vocabulary
    gathered = Implementation(loss_parallel=False)
    assert logit_bytes(cfg, tp4, gathered) == 12 * 2048 * 1000
    cfg.train.loss, cfg.train.loss_chunk_tokens = "chunked_cross_entropy", 256
    assert logit_bytes(cfg, tp4) == 12 * 256 * 250
    cfg.train.z_loss_weight = 1e-4  # logsumexp keeps the fp32 copy and adds its gradient
    assert logit_bytes(cfg, tp4) == 20 * 256 * 250


def test_the_compiled_loss_holds_the_logits_and_their_gradient_in_the_model_dtype():
    """train.compile fuses the fp32 upcast into the loss's kernels (kiln/train/loss.py): 4 bytes
    per bf16 logit, 8 per fp32 one, z-loss or not; vocabulary-sharded logits stay eager."""
    cfg = job("none")
    cfg.train.compile, cfg.train.z_loss_weight = True, 1e-4
    assert logit_bytes(cfg, ONE) == 4 * 2048 * 1000
    tp4 = {**ONE, "tp": 4}
    assert logit_bytes(cfg, tp4) == 20 * 2048 * 250
    assert logit_bytes(cfg, tp4, Implementation(loss_parallel=False)) == 4 * 2048 * 1000
    cfg.train.mixed_precision = "fp32"
    assert logit_bytes(cfg, ONE) == 8 * 2048 * 1000
    cfg.train.loss = "chunked_cross_entropy"  # eager, one chunk of all 2048 tokens
    assert logit_bytes(cfg, ONE) == 20 * 2048 * 1000


def test_context_parallel_divides_the_tokens_but_keeps_the_whole_keys_and_values():
    """cp=4: each rank's layers hold a quarter of the tokens, plus the three quarters of every
    layer's keys and values (2 × 1024 tokens × 8 heads × 64, bf16, twice) it gathered."""
    cp4 = {**ONE, "cp": 4}
    none, full = (activation_bytes(job(ac), cp4) for ac in ("none", "full"))
    tokens = 2048 / 4
    gathered = 2 * 2 * 2 * 1024 * 8 * 64
    assert gathered_kv_bytes(job("none"), cp4) == gathered
    assert none.kept == 8 * (LAYER * tokens + gathered * 3 / 4)
    # Checkpointed layers keep only their input; the one being recomputed holds its gather.
    assert full.kept == 8 * 2 * 512 * tokens
    assert full.recompute == (LAYER + TRANSIENT) * tokens + gathered * 3 / 4
    assert gathered_kv_bytes(job("none"), ONE) == 0


def test_each_cp_mode_keeps_and_sends_what_its_exchange_needs():
    """cp=4, 512 tokens a rank (2 sequences × 1024 / 4). Its own keys and values are 512 × 1024
    × 2 bytes = 1 MiB (a ring block), the whole sequences' 4 MiB."""
    cp4, mib = {**ONE, "cp": 4}, 2**20
    modes = {}
    for mode in ("all_gather", "all_to_all", "ring"):
        cfg = job("none")
        cfg.distributed.cp_mode = mode
        modes[mode] = cfg
    held = {mode: cp_held_bytes(cfg, cp4) for mode, cfg in modes.items()}
    # The all-gather keeps the other three ranks' 3 MiB; the all-to-all and the ring a second
    # bf16 copy of their output (512 × 512 × 2), over the heads.
    assert held == {"all_gather": 3 * mib, "all_to_all": mib / 2, "ring": mib / 2}
    sent = {mode: cp_exchange_bytes(cfg, cp4) for mode, cfg in modes.items()}
    # Forward: the all-gather brings in 3 MiB, the ring sends 3 blocks of 1 MiB; the all-to-all
    # 3/4 of its queries, keys, values and output (512 × 4 × 512 × 2 bytes).
    assert sent == {"all_gather": 3 * mib, "all_to_all": 1.5 * mib, "ring": 3 * mib}
    # Backward: the ring's 3 blocks again and the 4 sends of each block's fp32 gradient (2 MiB).
    assert cp_exchange_bytes(modes["ring"], cp4, backward=True) == 3 * mib + 4 * 2 * mib
    assert cp_exchange_bytes(modes["all_gather"], cp4, backward=True) == 3 * mib
    ring = activation_bytes(modes["ring"], cp4)
    assert ring.kept == 8 * (LAYER * 512 + mib / 2)
    # Attention's backward holds the block in hand and the one arriving (1 MiB each, bf16) and
    # their fp32 gradients (2 MiB each): 6 MiB, more than the feed-forward's 7168 × 512 bytes,
    # which are freed before it runs; the larger of the two.
    assert ring.recompute == 6 * mib > TRANSIENT * 512
    modes["ring"].train.activation_checkpointing = "full"
    recomputed = activation_bytes(modes["ring"], cp4)
    assert recomputed.kept == 8 * 2 * 512 * 512
    assert recomputed.recompute == LAYER * 512 + mib / 2 + 6 * mib


def test_fsdp_holds_the_largest_unit_in_flight_and_the_root_unit_for_the_step():
    cfg = job("full")
    m = cfg.model
    # Attention: wq, wo 512 × 512 and wk, wv 512 × 512 (8 kv heads); the feed-forward 3 × 512 ×
    # 1024, the larger. The root: embeddings and head, 1000 × 512 each.
    assert largest_unit_params(m, ONE) == 3 * 512 * 1024
    assert root_unit_params(m, ONE) == 2 * 1000 * 512
    fsdp = {**ONE, "dp_shard": 4, "tp": 2}
    assert largest_unit_params(m, fsdp) == 3 * 512 * 1024 / 2
    expected = 10 * 3 * 512 * 1024 / 2 + 2 * 2 * 1000 * 512 / 2 + 2 * 1000 * 512 / 2
    assert gathered_unit_bytes(cfg, fsdp) == expected
    # A pipeline's last stage holds the head only.
    assert root_unit_params(m, {**fsdp, "pp": 2}) == 1000 * 512 / 2
    # Without FSDP, autocast's bf16 copy of every weight one rank holds.
    assert gathered_unit_bytes(cfg, ONE) == 2 * count_params(m).total
    cfg.train.mixed_precision = "fp32"
    assert gathered_unit_bytes(cfg, ONE) == 0


def test_the_peak_is_the_loss_s_moment_or_the_backward_s():
    """Gradients are set to None after each step: at the loss there are none (but those of
    earlier micro-batches when accumulating), the logits are freed before they build up."""
    e = MemoryEstimate(
        weights=1, grads=10, optimizer=2, activations=3, recompute=4, logits=20, gathered=5
    )
    assert peak_bytes(e) == e.total == 1 + 2 + 5 + 3 + max(20, 10 + 4)
    assert replace(e, logits=6).total == 1 + 2 + 5 + 3 + 10 + 4
    assert replace(e, accumulating=True).total == 1 + 2 + 5 + 3 + 20 + 10
    cfg = job("full")
    cfg.train.grad_accum_steps = 2
    assert estimate_memory(cfg, ONE).accumulating


def test_fit_adds_the_allocator_overhead_and_the_cuda_context():
    estimate = estimate_memory(job("full"), ONE)
    room = estimate.total * (1 + ALLOCATOR_OVERHEAD) + CONTEXT_BYTES
    assert estimate.reserved == pytest.approx(estimate.total * (1 + ALLOCATOR_OVERHEAD))
    assert fits(estimate, room + 1) and not fits(estimate, room - 1e6)


def test_model_state_is_sharded_over_every_parameter_splitting_dim():
    cfg = job("full")
    whole = estimate_memory(cfg, ONE).model_state
    assert whole == 16 * count_params(cfg.model).total
    split = estimate_memory(cfg, {**ONE, "dp_shard": 4, "tp": 2, "dp_replicate": 3}).model_state
    assert split == whole / 8


def muon_params(m: ModelConfig) -> int:
    """What build_optimizer gives Muon (the model on the meta device: nothing allocated)."""
    plan = family_of(m).parallel_plan(m)
    io_modules = plan.first_stage + plan.last_stage
    optimizers = build_optimizer(
        build_model(m), OptimizerConfig(name="muon"), io_modules=io_modules
    )
    muon = [o for o in optimizers if isinstance(o, Muon)]
    return sum(p.numel() for o in muon for group in o.param_groups for p in group["params"])


@pytest.mark.parametrize(
    "model",
    [
        {},
        dict(tie_embeddings=True),
        dict(qk_norm=True),
        dict(moe=MoEConfig(num_experts=4, top_k=2, ffn_hidden_dim=64, first_dense_layers=1)),
        dict(
            moe=MoEConfig(
                num_experts=4,
                top_k=2,
                ffn_hidden_dim=64,
                shared_experts=1,
                shared_expert_gate=True,
                router="sigmoid",
                bias_update_rate=0.01,
            )
        ),
    ],
)
def test_muon_matrices_are_those_build_optimizer_gives_muon(model):
    m = ModelConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=100, **model)
    assert muon_matrix_params(m) == muon_params(m)
    head = 0 if m.tie_embeddings else count_params(m).embedding
    assert 0 < muon_matrix_params(m) < count_params(m).total - count_params(m).embedding - head


def test_model_state_per_optimizer():
    """8 bytes of fp32 weight and gradient per parameter, and the state: AdamW's two moments and
    Schedule-Free's z and v 8, Lion's momentum 4, Muon's momentum 4 for its matrices and
    AdamW's 8 for the embeddings, head and norms."""
    cfg = job("full")
    total, matrices = count_params(cfg.model).total, muon_matrix_params(cfg.model)
    state = {name: model_state_bytes(cfg.model, ONE, name) for name in OPTIMIZER_NAMES}
    assert state["adamw"] == state["schedule_free_adamw"] == 16 * total
    assert state["lion"] == 12 * total
    assert state["muon"] == 12 * matrices + 16 * (total - matrices)
    assert state["lion"] < state["muon"] < state["adamw"]
    cfg.optimizer.name = "muon"
    assert estimate_memory(cfg, ONE).model_state == state["muon"]
    # Sharded like the rest: every dimension that splits parameters divides each share.
    split = {**ONE, "dp_shard": 4, "tp": 2, "pp": 2}
    assert model_state_bytes(cfg.model, split, "muon") == pytest.approx(state["muon"] / 16)
