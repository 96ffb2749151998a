"""The planner's memory terms for Mixture-of-Experts models (kiln/plan/): every expert's weights,
the top-k experts' activations, expert parallel's split of the experts, FSDP's split of each
expert's rows and its whole-expert chunks where the rows do not divide; the MoE feed-forward's
activations held to what the block saves, measured with saved-tensor hooks."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

from kiln.cli import main
from kiln.config import JobConfig, ModelConfig, MoEConfig
from kiln.model import count_params
from kiln.model.llama.model import Block
from kiln.model.moe import MoEFeedForward
from kiln.model.moe.experts import GroupedExperts
from kiln.model.rope import model_rope_tables
from kiln.parallel.fsdp import _within_experts
from kiln.plan.activations import (
    activation_bytes,
    layer_bytes_per_token,
    moe_ffn_bytes_per_token,
)
from kiln.plan.memory import (
    estimate_memory,
)
from kiln.plan.model_state import (
    ExpertShards,
    expert_shards,
    expert_weight_dims,
    model_state_bytes,
    muon_matrix_params,
    routed_expert_params,
)
from tests.conftest import REPO
from tests.unit.test_plan_memory import LAYER, ONE, TRANSIENT, job

MOE = dict(num_experts=8, top_k=2, ffn_hidden_dim=256)


def moe_job(ac: str = "none", **moe) -> JobConfig:
    """`job(ac)` with experts: MOE's [model.moe] keys and these."""
    cfg = job(ac)
    cfg.model.moe = MoEConfig(**{**MOE, **moe})
    return cfg


def test_moe_model_state_counts_every_expert():
    small, big = moe_job(), moe_job(num_experts=16)
    assert estimate_memory(small, ONE).model_state == 16 * count_params(small.model).total
    added = 8 * 8 * 3 * 512 * 256 + 8 * 8 * 512  # 8 layers × 8 more experts, and their router rows
    assert estimate_memory(big, ONE).model_state - estimate_memory(small, ONE).model_state == (
        16 * added
    )


def test_expert_parallel_splits_the_experts_and_fsdp_shards_the_rest_over_dp_shard_x_ep():
    cfg = moe_job()
    total, experts = count_params(cfg.model).total, routed_expert_params(cfg.model)
    assert experts == 8 * 8 * 3 * 512 * 256  # 8 MoE layers × 8 experts × w1, w2, w3
    dense = total - experts
    # tp=2 × ep=2 × dp_shard=2: each ep rank holds 4 experts, sharded over dp_shard × tp = 4
    # ranks (a quarter of each expert's rows each); the rest TP-split and sharded over
    # dp_shard × ep.
    layout = {**ONE, "ep": 2, "dp_shard": 2, "tp": 2}
    assert expert_shards(cfg.model, layout) == ExpertShards(local=4, ranks=4, whole=())
    assert estimate_memory(cfg, layout).model_state == 16 * (dense / 8 + experts / 8)
    # HSDP replicates: dp_replicate divides nothing.
    hsdp = {**layout, "dp_replicate": 2}
    assert estimate_memory(cfg, hsdp).model_state == estimate_memory(cfg, layout).model_state
    # ep alone: each rank holds half the experts whole and half of the dense state.
    ep2 = {**ONE, "ep": 2}
    assert estimate_memory(cfg, ep2).model_state == 16 * (dense / 2 + experts / 2)


def test_expert_parallel_ranks_count_as_sharding_ranks():
    # The same 4 ranks share the state whether they are 4 FSDP ranks or 2 × 2 with ep (the ep
    # ranks read other batches, so FSDP shards the dense parameters over them too).
    cfg = moe_job()
    fsdp = estimate_memory(cfg, {**ONE, "dp_shard": 4}).model_state
    assert estimate_memory(cfg, {**ONE, "dp_shard": 2, "ep": 2}).model_state == fsdp
    assert fsdp == 16 * count_params(cfg.model).total / 4


def test_expert_weight_dims_are_dims_1_and_2_of_the_stacked_weights():
    m = ModelConfig(dim=96, moe=MoEConfig(num_experts=4, top_k=1, ffn_hidden_dim=40))
    experts = GroupedExperts(m.moe.num_experts, m.dim, m.expert_hidden_dim)
    assert expert_weight_dims(m) == {n: tuple(p.shape[1:]) for n, p in experts.named_parameters()}
    assert expert_weight_dims(m) == {"w1": (40, 96), "w2": (96, 40), "w3": (40, 96)}


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 6, 8, 16, 24, 32])
def test_whole_expert_weights_are_those_fsdp_leaves_on_the_expert_dimension(ranks):
    """The estimate's per-weight rule is the placement kiln gives FSDP (parallel/fsdp.py): a
    weight is split in whole experts exactly where its placement falls back to the default."""
    m = ModelConfig(dim=96, moe=MoEConfig(num_experts=4, top_k=1, ffn_hidden_dim=48))
    placement = _within_experts(ranks)
    experts = GroupedExperts(m.moe.num_experts, m.dim, m.expert_hidden_dim)
    defaulted = tuple(n for n, p in experts.named_parameters() if placement(p) is None)
    assert sorted(expert_shards(m, {**ONE, "dp_shard": ranks}).whole) == sorted(defaulted)


def test_fsdp_splits_each_experts_rows_when_they_divide():
    cfg = moe_job()
    experts = routed_expert_params(cfg.model)
    dense = count_params(cfg.model).total - experts
    # 4 experts per ep rank over dp_shard × tp = 16 ranks (the 32-GPU recipe's shape): rows of
    # 256 (w1, w3) and 512 (w2) divide by 16, so every rank holds 1/16 of each of the 4 experts,
    # no padding: the experts' state is divided over all 32 ranks like the dense state.
    layout = {**ONE, "ep": 2, "dp_shard": 4, "tp": 4}
    shards = expert_shards(cfg.model, layout)
    assert shards == ExpertShards(local=4, ranks=16, whole=())
    assert shards.stored == 4 / 16 and not shards.padded
    assert estimate_memory(cfg, layout).model_state == pytest.approx(16 * (dense + experts) / 32)
    # Pipeline stages split the layers, experts included.
    piped = {**layout, "pp": 2}
    assert estimate_memory(cfg, piped).model_state == pytest.approx(16 * (dense + experts) / 64)
    # Without ep the same: 8 experts over 32 ranks, a quarter of an expert each.
    fsdp = {**ONE, "dp_shard": 8, "tp": 4}
    assert expert_shards(cfg.model, fsdp).stored == 8 / 32
    assert estimate_memory(cfg, fsdp).model_state == estimate_memory(cfg, layout).model_state


def test_rows_that_do_not_divide_leave_whole_experts_on_the_busiest_rank():
    cfg = moe_job()
    experts = routed_expert_params(cfg.model)
    dense = count_params(cfg.model).total - experts
    # 4 experts per ep rank over dp_shard = 6 ranks: neither 256 nor 512 rows divide by 6, so
    # FSDP cuts every weight in whole experts: 4 ranks hold one each, 2 the same size in padding.
    layout = {**ONE, "ep": 2, "dp_shard": 6}
    shards = expert_shards(cfg.model, layout)
    assert shards == ExpertShards(local=4, ranks=6, whole=("w1", "w2", "w3"))
    assert shards.chunk == 1 and shards.stored == 1 and shards.padded
    assert estimate_memory(cfg, layout).model_state == pytest.approx(
        16 * (dense / 12 + experts / 8)
    )
    # Hidden 192 divides by 6 and dim 512 does not: w1 and w3 split their rows, w2 (experts,
    # dim, hidden) its columns, 4/6 of an expert each, no padding.
    narrow = moe_job(ffn_hidden_dim=192)
    experts = routed_expert_params(narrow.model)
    dense = count_params(narrow.model).total - experts
    shards = expert_shards(narrow.model, layout)
    assert shards.whole == () and not shards.padded
    assert shards.stored == pytest.approx(4 / 6)
    expected = 16 * (dense / 12 + experts * shards.stored / 8)
    assert estimate_memory(narrow, layout).model_state == pytest.approx(expected)
    # Rows that do not divide but experts that do: whole experts, no padding.
    m = ModelConfig(dim=100, moe=MoEConfig(num_experts=12, top_k=1, ffn_hidden_dim=100))
    shards = expert_shards(m, {**ONE, "dp_shard": 3})
    assert shards.whole == ("w1", "w2", "w3") and not shards.padded and shards.stored == 4


@pytest.mark.parametrize("local, ranks", [(4, 4), (8, 2), (4, 16), (8, 3), (5, 4), (1, 8)])
def test_expert_chunks_are_fsdp2s(local, ranks):
    """Where the rows do not divide (1001 by none of these), the estimate's chunk is the one
    torch's FSDP2 stores on every rank (its rank 0's, padded on the others) when it shards the
    expert dimension."""
    chunks = _chunk_with_empty(torch.empty(local, 1), ranks, dim=0)
    m = ModelConfig(dim=1001, moe=MoEConfig(num_experts=2 * local, top_k=1, ffn_hidden_dim=1001))
    shards = expert_shards(m, {**ONE, "ep": 2, "dp_shard": ranks})
    assert (shards.local, shards.ranks, shards.whole) == (local, ranks, ("w1", "w2", "w3"))
    assert shards.chunk == shards.stored == len(chunks[0])


@pytest.mark.parametrize("local, ranks", [(4, 4), (8, 2), (4, 16), (8, 32), (1, 8)])
def test_split_rows_are_fsdp2s(local, ranks):
    """Where the rows divide, every rank stores rows / ranks of each expert: local / ranks
    experts' worth, whatever the number of experts."""
    m = ModelConfig(dim=256, moe=MoEConfig(num_experts=2 * local, top_k=1, ffn_hidden_dim=512))
    chunks = _chunk_with_empty(torch.empty(local, m.dim, 1), ranks, dim=1)
    assert {chunk.shape for chunk in chunks} == {(local, m.dim // ranks, 1)}
    shards = expert_shards(m, {**ONE, "ep": 2, "dp_shard": ranks})
    assert not shards.whole and not shards.padded
    assert shards.stored == pytest.approx(chunks[0].numel() / m.dim)


def test_kiln_check_names_the_expert_share_and_the_padding(capsys):
    recipe = str(REPO / "configs" / "train" / "debug_moe.toml")
    assert main(["check", recipe, "--config-only", "--world-size", "4", "--distributed.ep=2"]) == 0
    out = capsys.readouterr().out
    assert "(fp32 weights, grads, AdamW of this ep rank's 4 of 8 experts)" in out
    assert main(["check", recipe, "--config-only", "--optimizer.name=muon"]) == 0
    assert "(fp32 weights, grads, Muon/AdamW state of all 8 experts)" in capsys.readouterr().out
    assert "# experts:" not in out  # 4 experts over 2 FSDP ranks divide evenly
    # 4 experts over 8 ranks: the rows (128) divide, so no padding either.
    assert main(["check", recipe, "--config-only", "--world-size", "16", "--distributed.ep=2"]) == 0
    assert "# experts:" not in capsys.readouterr().out
    # Over 6 ranks dim 128 does not divide, hidden 96 does: every weight splits by it.
    narrow = ["--world-size", "12", "--distributed.ep=2", "--model.moe.ffn_hidden_dim=96"]
    assert main(["check", recipe, "--config-only", *narrow]) == 0
    assert "# experts:" not in capsys.readouterr().out
    assert main(["check", recipe, "--config-only", "--world-size", "12", "--distributed.ep=2"]) == 0
    assert (
        "# experts: neither the expert hidden size (128) nor dim (128) divides over the 6 ranks "
        "(dp_shard × tp) that shard each ep rank's 4 experts of an MoE layer, so FSDP splits "
        "them in chunks of 1 whole expert: 4 of those ranks hold experts"
    ) in capsys.readouterr().out


def test_moe_activations_grow_with_top_k_not_with_the_number_of_experts():
    tokens, layers = 2048, 8
    base = estimate_memory(moe_job(), ONE).activations
    more_experts = estimate_memory(moe_job(num_experts=16), ONE).activations
    # Only the router's three fp32 score rows grow with the experts.
    assert more_experts - base == layers * tokens * 3 * 4 * 8
    top4 = estimate_memory(moe_job(top_k=4), ONE).activations
    per_copy = 2 * (3 * 512 + 4 * 256) + 8 + 8 + 4  # rows in/out/combined, 4 hidden, index, weight
    assert top4 - base == layers * tokens * 2 * per_copy


def test_moe_blocks_after_dense_ones_and_checkpointing():
    first_dense = moe_job("none", first_dense_layers=2)
    dense_layer, moe_layer = (layer_bytes_per_token(first_dense.model, moe=m) for m in (0, 1))
    # An MoE block keeps attention, its norm's input and the MoE feed-forward's own rows.
    assert moe_layer == LAYER - 1024 - 8192 + moe_ffn_bytes_per_token(first_dense.model)
    tokens = 2048
    none = activation_bytes(first_dense, ONE)
    assert none.kept == tokens * (2 * dense_layer + 6 * moe_layer)
    full = activation_bytes(moe_job("full", first_dense_layers=2), ONE)
    # Every block keeps its input, and one block (an MoE one, the bigger) is being recomputed.
    assert full.kept == tokens * 8 * 2 * 512
    assert full.recompute == tokens * (moe_layer + TRANSIENT)


def test_tensor_parallel_divides_moe_activations_by_the_sequence_shard():
    """Each tp rank routes its own quarter of the sequence; only attention's gathered input
    (2 × dim per token) stays whole."""
    whole = activation_bytes(moe_job(), ONE).kept
    gathered = 8 * 2048 * 2 * 512
    split = activation_bytes(moe_job(), {**ONE, "tp": 4}).kept
    assert split == pytest.approx((whole - gathered) / 4 + gathered)


def _saved_bytes(module: torch.nn.Module, tokens: int, dim: int) -> int:
    """Bytes of the distinct tensors one forward saves for backward, parameters excluded."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    x = torch.randn(2, tokens // 2, dim, requires_grad=True)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
    ):
        module(x)
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    return sum(size for ptr, size in storages.items() if ptr not in weights)


@pytest.mark.parametrize(
    "model",
    [
        dict(moe=MoEConfig(num_experts=8, top_k=2, ffn_hidden_dim=128)),
        dict(moe=MoEConfig(num_experts=8, top_k=2, ffn_hidden_dim=128, shared_experts=1)),
        dict(
            dim=256,
            moe=MoEConfig(
                num_experts=16,
                top_k=4,
                ffn_hidden_dim=64,
                router="sigmoid",
                aux_loss_weight=0.01,
                router_z_loss_weight=0.001,
            ),
        ),
    ],
)
def test_moe_ffn_estimate_matches_what_the_block_saves(model):
    cfg = ModelConfig(**{"dim": 128, **model})
    torch.manual_seed(0)
    moe = MoEFeedForward(cfg)
    for parameter in moe.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    moe.init_buffers()
    # The difference between two token counts leaves what grows with the tokens.
    per_token = (_saved_bytes(moe, 512, cfg.dim) - _saved_bytes(moe, 256, cfg.dim)) / 256
    assert per_token == pytest.approx(moe_ffn_bytes_per_token(cfg), rel=0.02)


def _block_saved_bytes(block: Block, cfg: ModelConfig, batch: int, seq: int) -> int:
    """Bytes a bf16 block (FSDP's compute dtype) saves for backward, weights and the rope tables
    (the same for every sequence) excluded."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    cos, sin = model_rope_tables(cfg, device=None)
    x = torch.randn(batch, seq, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        block(x, cos, sin)
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in (cos, sin)}
    return sum(size for ptr, size in storages.items() if ptr not in skip)


@pytest.mark.parametrize(
    "shape",
    [
        dict(dim=128, n_heads=4, n_kv_heads=2, ffn_hidden_dim=384),
        dict(dim=256, n_heads=8, n_kv_heads=8, ffn_hidden_dim=512),
        dict(dim=256, n_heads=8, n_kv_heads=2, ffn_hidden_dim=1024, qk_norm=False),
    ],
)
def test_dense_block_estimate_matches_what_the_block_saves(shape):
    """Per token, a Llama block saves what `layer_bytes_per_token` counts for CUDA, where
    RMSNorm is one fused kernel keeping its bf16 input and rstd. On CPU the norm runs as
    separate operations, which keep its input and output in fp32 as well: 6 × dim more per
    norm, two norms a block."""
    cfg = ModelConfig(max_seq_len=64, **shape)
    block = Block(cfg, 0).to(torch.bfloat16)
    per_token = (
        _block_saved_bytes(block, cfg, 4, 64) - _block_saved_bytes(block, cfg, 2, 64)
    ) / 128
    cpu_norms = 2 * 6 * cfg.dim
    assert per_token == layer_bytes_per_token(cfg, moe=False) + cpu_norms


def test_muon_counts_the_routed_experts_as_its_matrices():
    cfg = moe_job()
    total, experts = count_params(cfg.model).total, routed_expert_params(cfg.model)
    matrices = muon_matrix_params(cfg.model)
    assert experts < matrices  # experts, router, attention
    rest = total - matrices
    assert model_state_bytes(cfg.model, ONE, "muon") == 12 * matrices + 16 * rest
    # Over 6 FSDP ranks within each of 2 ep ranks, whole experts: the busiest rank holds one
    # of its 4 experts whole (see below), at Muon's 12 bytes.
    layout = {**ONE, "ep": 2, "dp_shard": 6}
    dense = (12 * (matrices - experts) + 16 * rest) / 12
    assert model_state_bytes(cfg.model, layout, "muon") == pytest.approx(dense + 12 * experts / 8)
