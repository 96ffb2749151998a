"""kiln check's memory estimate: checkpointing, sharding, and MoE (every expert's weights,
the top-k experts' activations, expert parallel's split of the experts and FSDP's whole-expert
chunks)."""

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

from kiln.cli import main
from kiln.config import JobConfig, ModelConfig
from kiln.metrics.memory import (
    estimate_memory,
    expert_shards,
    layer_bytes_per_token,
    moe_ffn_bytes_per_token,
    routed_expert_params,
)
from kiln.model import count_params
from kiln.model.moe import MoEFeedForward
from tests.conftest import REPO

ONE = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}


def job(ac: str) -> JobConfig:
    cfg = JobConfig(
        model=ModelConfig(
            dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=1000, ffn_hidden_dim=1024
        )
    )
    cfg.train.seq_len, cfg.train.batch_size, cfg.train.activation_checkpointing = 1024, 2, ac
    return cfg


def test_activation_checkpointing_trades_memory_in_order():
    none, selective, full = (
        estimate_memory(job(ac), ONE).activations for ac in ("none", "selective", "full")
    )
    assert full < selective < none
    tokens, dim = 2048, 512
    logits = 8 * tokens * 1000
    assert none == 8 * 34 * tokens * dim + logits
    assert full == 8 * 2 * tokens * dim + 34 * tokens * dim + logits


def test_model_state_is_sharded_over_every_parameter_splitting_dim():
    cfg = job("full")
    whole = estimate_memory(cfg, ONE).model_state
    assert whole == 16 * count_params(cfg.model).total
    split = estimate_memory(cfg, {**ONE, "dp_shard": 4, "tp": 2, "dp_replicate": 3}).model_state
    assert split == whole / 8


MOE = dict(num_experts=8, moe_top_k=2, moe_ffn_hidden_dim=256)


def moe_job(ac: str = "none", **model) -> JobConfig:
    cfg = job(ac)
    for key, value in {**MOE, **model}.items():
        setattr(cfg.model, key, value)
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
    # ranks (one expert each); the rest TP-split and sharded over dp_shard × ep.
    layout = {**ONE, "ep": 2, "dp_shard": 2, "tp": 2}
    assert expert_shards(cfg.model, layout) == (4, 4, 1)
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


def test_fewer_experts_than_fsdp_ranks_leave_whole_experts_on_the_busiest_rank():
    cfg = moe_job()
    experts = routed_expert_params(cfg.model)
    dense = count_params(cfg.model).total - experts
    # 4 experts per ep rank over dp_shard × tp = 16 ranks (the 32-GPU recipe's shape): FSDP cuts
    # whole experts, 4 ranks hold one each and 12 the same size in padding.
    layout = {**ONE, "ep": 2, "dp_shard": 4, "tp": 4}
    assert expert_shards(cfg.model, layout) == (4, 16, 1)
    assert estimate_memory(cfg, layout).model_state == 16 * (dense / 32 + experts / 8)
    # Pipeline stages split the layers, experts included.
    piped = {**layout, "pp": 2}
    assert estimate_memory(cfg, piped).model_state == 16 * (dense / 64 + experts / 16)


@pytest.mark.parametrize("local, ranks", [(4, 4), (8, 2), (4, 16), (8, 3), (5, 4), (1, 8)])
def test_expert_chunks_are_fsdp2s(local, ranks):
    """The estimate's chunk is the one torch's FSDP2 stores on every rank (its rank 0's, padded
    on the others) when it shards the expert dimension."""
    chunks = _chunk_with_empty(torch.empty(local, 1), ranks, dim=0)
    m = ModelConfig(num_experts=2 * local, moe_top_k=1)
    assert expert_shards(m, {**ONE, "ep": 2, "dp_shard": ranks}) == (local, ranks, len(chunks[0]))


def test_kiln_check_names_the_expert_share_and_the_padding(capsys):
    recipe = str(REPO / "configs" / "train" / "debug_moe.toml")
    assert main(["check", recipe, "--config-only", "--world-size", "4", "--distributed.ep=2"]) == 0
    out = capsys.readouterr().out
    assert "(fp32 weights, grads, AdamW of this ep rank's 4 of 8 experts)" in out
    assert "# experts: FSDP shards" not in out  # 4 experts over 2 FSDP ranks divide evenly
    assert main(["check", recipe, "--config-only", "--world-size", "16", "--distributed.ep=2"]) == 0
    out = capsys.readouterr().out
    assert (
        "# experts: FSDP shards each ep rank's 4 experts of an MoE layer over 8 ranks "
        "(dp_shard × tp) in chunks of 1 whole expert: 4 of those ranks hold experts"
    ) in out


def test_moe_activations_grow_with_top_k_not_with_the_number_of_experts():
    tokens, layers = 2048, 8
    base = estimate_memory(moe_job(), ONE).activations
    more_experts = estimate_memory(moe_job(num_experts=16), ONE).activations
    # Only the router's three fp32 score rows grow with the experts.
    assert more_experts - base == layers * tokens * 3 * 4 * 8
    top4 = estimate_memory(moe_job(moe_top_k=4), ONE).activations
    per_copy = 2 * (3 * 512 + 4 * 256) + 8 + 8 + 4  # rows in/out/combined, 4 hidden, index, weight
    assert top4 - base == layers * tokens * 2 * per_copy


def test_moe_blocks_after_dense_ones_and_checkpointing():
    first_dense = moe_job("none", moe_first_dense_layers=2)
    dense_layer, moe_layer = (layer_bytes_per_token(first_dense.model, moe=m) for m in (0, 1))
    tokens, logits = 2048, 8 * 2048 * 1000
    none = estimate_memory(first_dense, ONE).activations
    assert none == tokens * (2 * dense_layer + 6 * moe_layer) + logits
    full = estimate_memory(moe_job("full", moe_first_dense_layers=2), ONE).activations
    # Every block keeps its input, and one block (an MoE one, the bigger) is being recomputed.
    assert full == tokens * (8 * 2 * 512 + moe_layer) + logits


def test_tensor_parallel_divides_moe_activations_by_the_sequence_shard():
    whole = estimate_memory(moe_job(), ONE).activations
    assert estimate_memory(moe_job(), {**ONE, "tp": 4}).activations == whole / 4


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
        dict(num_experts=8, moe_top_k=2, moe_ffn_hidden_dim=128),
        dict(num_experts=8, moe_top_k=2, moe_ffn_hidden_dim=128, moe_shared_experts=1),
        dict(
            dim=256,
            num_experts=16,
            moe_top_k=4,
            moe_ffn_hidden_dim=64,
            moe_router="sigmoid",
            moe_aux_loss_weight=0.01,
            moe_router_z_loss_weight=0.001,
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
