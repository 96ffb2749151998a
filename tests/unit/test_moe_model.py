"""The Llama model with MoE blocks: names, meta build and materialize, init, parameter counts,
training forward/backward in one process."""

import math
from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import Shard

from kiln.config import JobConfig, ModelConfig, MoEConfig
from kiln.model import KVCache, build_model, count_params, flops_per_token, materialize
from kiln.model import init as tiled
from kiln.model.feed_forward import FeedForward
from kiln.model.moe import AuxLossScale, MoEFeedForward
from kiln.parallel.apply import apply_parallelism

MOE = ModelConfig(
    dim=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=61,
    ffn_hidden_dim=48,
    max_seq_len=32,
    moe=MoEConfig(
        num_experts=4,
        top_k=2,
        first_dense_layers=1,
        frequency=2,
        ffn_hidden_dim=16,
        shared_experts=2,
        shared_expert_gate=True,
        aux_loss_weight=0.01,
        router_z_loss_weight=0.001,
    ),
)


def tokens(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, 61, (batch, seq), generator=torch.Generator().manual_seed(0))


def test_blocks_and_names():
    model = build_model(MOE)
    kinds = [type(model.layers[str(i)].feed_forward) for i in range(4)]
    assert kinds == [FeedForward, MoEFeedForward, FeedForward, MoEFeedForward]
    names = {name for name, _ in model.named_parameters()}
    for name in (
        "layers.1.feed_forward.router.gate.weight",
        "layers.1.feed_forward.experts.w1",
        "layers.1.feed_forward.experts.w2",
        "layers.1.feed_forward.experts.w3",
        "layers.1.feed_forward.shared_experts.w1.weight",
        "layers.1.feed_forward.shared_gate.weight",
        "layers.0.feed_forward.w1.weight",
    ):
        assert name in names, name
    experts = model.layers["1"].feed_forward.experts
    assert experts.w1.shape == (4, 16, 32) and experts.w2.shape == (4, 32, 16)
    state = build_model(MOE, device="cpu").state_dict()
    assert "layers.1.feed_forward.router.expert_bias" in state
    assert "layers.1.feed_forward.router.tokens_per_expert" not in state


def test_param_counts_total_and_active():
    model = build_model(MOE)
    counts = count_params(MOE)
    assert counts.total == sum(p.numel() for p in model.parameters())
    unused_experts = 2 * (4 - 2) * 3 * 32 * 16  # two MoE layers, 2 of 4 experts idle per token
    assert counts.active == counts.total - unused_experts
    dense = replace(MOE, moe=MoEConfig())
    assert count_params(dense).active == count_params(dense).total
    # FLOPs count the weights a token goes through: the router, 2 experts, the shared experts.
    moe_layer = 32 * 4 + 2 * 3 * 32 * 16 + 3 * 32 * 32 + 32
    dense_layer = 3 * 32 * 48
    delta = 6 * 2 * (moe_layer - dense_layer)
    assert flops_per_token(MOE, 16) - flops_per_token(dense, 16) == delta


def test_materialize_from_meta_zeroes_the_balancing_buffers():
    model = build_model(MOE)
    assert model.layers["1"].feed_forward.router.expert_bias.is_meta
    materialize(model, device="cpu", seed=0)
    router = model.layers["1"].feed_forward.router
    assert torch.equal(router.expert_bias, torch.zeros(4))
    assert torch.equal(router.tokens_per_expert, torch.zeros(4, dtype=torch.int64))
    router.expert_bias.fill_(7.0)  # what to_empty may leave behind
    router.tokens_per_expert.fill_(7)
    model.init_buffers()
    assert router.expert_bias.abs().sum() == 0 and router.tokens_per_expert.sum() == 0


def test_init_std_and_layout_independence():
    cfg = replace(MOE, dim=128, n_heads=4, moe=replace(MOE.moe, ffn_hidden_dim=256))
    model = materialize(build_model(cfg), device="cpu", seed=0)
    moe = model.layers["1"].feed_forward
    assert abs(moe.experts.w1.std().item() - 0.02) < 0.001
    assert abs(moe.experts.w2.std().item() - 0.02 / math.sqrt(2 * 4)) < 0.0005
    assert abs(moe.router.gate.weight.std().item() - 0.02) < 0.002
    assert abs(moe.shared_experts.w2.weight.std().item() - 0.02 / math.sqrt(2 * 4)) < 0.0005
    # Every expert is drawn from its own tiles: an expert-sharded rank draws exactly its slice.
    name = "layers.1.feed_forward.experts.w1"
    for rank in range(2):
        regions = tiled.shard_regions(tuple(moe.experts.w1.shape), (2,), [rank], (Shard(0),))
        local = torch.empty(2, 256, 128)
        tiled.fill_normal_local(local, (4, 256, 128), regions, std=0.02, seed=0, name=name)
        assert torch.equal(local, moe.experts.w1[2 * rank : 2 * rank + 2])


def test_forward_backward_trains_every_parameter():
    model = materialize(build_model(MOE), device="cpu", seed=0)
    model(tokens(), moe_scale=AuxLossScale(record=True)).logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    router = model.layers["1"].feed_forward.router
    assert router.tokens_per_expert.sum() == 2 * 12 * 2  # tokens × top_k
    assert set(model.layers["1"].feed_forward.aux_losses) == {
        "load_balance",
        "seq_balance",
        "router_z",
    }


@pytest.mark.parametrize("shared", [0, 2])
@pytest.mark.parametrize("aux", [0.0, 0.01])
def test_the_moe_block_returns_a_tensor_of_its_own(shared, aux):
    """FSDP2 warns that a unit which returns a view "can produce wrong gradients": under expert
    parallel the MoE block is such a unit, so its output must be no view (of its flat result,
    or of the identity that attaches the balancing loss)."""
    cfg = replace(MOE, moe=replace(MOE.moe, shared_experts=shared, aux_loss_weight=aux))
    block = materialize(build_model(cfg), device="cpu", seed=0).layers["1"].feed_forward
    x = torch.randn(2, 12, 32, requires_grad=True)
    out = block(x)
    assert out.shape == x.shape and not out._is_view()
    out.sum().backward()
    assert block.router.gate.weight.grad is not None


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_same_gradients_same_counts(mode):
    plain = materialize(build_model(MOE), device="cpu", seed=0)
    plain(tokens()).logsumexp(-1).mean().backward()
    cfg = JobConfig(model=MOE)
    cfg.train.activation_checkpointing = mode
    wrapped = build_model(MOE)
    apply_parallelism(wrapped, cfg)
    materialize(wrapped, device="cpu", seed=0)
    wrapped(tokens()).logsumexp(-1).mean().backward()
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    for layer in ("1", "3"):
        counts = [m.layers[layer].feed_forward.router.tokens_per_expert for m in (plain, wrapped)]
        assert torch.equal(*counts)


def test_kv_cache_decoding_matches_full_forward():
    model = materialize(build_model(MOE), device="cpu", seed=0)
    x = tokens(batch=1, seq=10)
    cache = KVCache(
        n_layers=4, batch=1, n_kv_heads=2, head_dim=8, max_len=16, device="cpu", dtype=torch.float32
    )
    with torch.no_grad():
        full = model(x)
        pieces = [model(x[:, :6], cache)] + [model(x[:, i : i + 1], cache) for i in range(6, 10)]
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5)
