import pytest
import torch

from kiln.config import JobConfig, ModelConfig
from kiln.model import KVCache, build_model, count_params, flops_per_token, materialize
from kiln.parallel.apply import apply_parallelism

TINY = ModelConfig(
    dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_hidden_dim=96, max_seq_len=64
)


def make(cfg: ModelConfig = TINY, seed: int = 0):
    return materialize(build_model(cfg), device="cpu", seed=seed)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_param_count_matches_the_module(tied, qk_norm):
    cfg = ModelConfig(**{**TINY.__dict__, "tie_embeddings": tied, "qk_norm": qk_norm})
    model = build_model(cfg)
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters())


def test_param_count_and_flops_by_hand():
    # dim 64, head_dim 16: q 64·64, k and v 64·32 each, o 64·64; SwiGLU 3·64·96; two norms of 64.
    per_layer_matmul = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96
    counts = count_params(TINY)
    assert counts.embedding == 97 * 64
    assert counts.matmul == 3 * per_layer_matmul + 97 * 64
    assert counts.total == 97 * 64 + 3 * (per_layer_matmul + 2 * 64) + 64 + 97 * 64
    seq = 32
    assert flops_per_token(TINY, seq) == 6 * (3 * per_layer_matmul + 97 * 64) + 6 * 3 * seq * 64


def test_llama3_8b_flops_are_the_usual_number():
    cfg = ModelConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336, vocab_size=128256
    )
    counts = count_params(cfg)
    assert abs(counts.total - 8.03e9) < 0.01e9
    # 7.50e9 matmul weights (8.03e9 less the 0.53e9 embedding table): 6·N ≈ 45.03 GFLOP/token,
    # plus 6·32·4096·4096 ≈ 3.22 GFLOP/token of causal attention.
    assert abs(flops_per_token(cfg, 4096) - 48.25e9) < 0.02e9


def test_same_seed_same_weights():
    a, b, c = make(seed=1), make(seed=1), make(seed=2)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_init_does_not_depend_on_wrappers():
    plain = make(seed=3)
    cfg = JobConfig(model=TINY)
    cfg.train.activation_checkpointing = "full"
    wrapped = build_model(TINY)
    apply_parallelism(wrapped, cfg)
    materialize(wrapped, device="cpu", seed=3)
    for p, q in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(p, q)


def test_depth_scaled_init():
    model = make(ModelConfig(**{**TINY.__dict__, "dim": 256, "ffn_hidden_dim": 512}))
    block = model.layers["0"]
    assert abs(block.attention.wq.weight.std().item() - 0.02) < 0.002
    assert abs(block.attention.wo.weight.std().item() - 0.02 / (2 * 3) ** 0.5) < 0.001
    assert torch.equal(block.ffn_norm.weight, torch.ones(256))
    assert abs(model.tok_embeddings.weight.std().item() - 1.0) < 0.05
    tied = make(ModelConfig(**{**TINY.__dict__, "dim": 256, "tie_embeddings": True}))
    assert abs(tied.tok_embeddings.weight.std().item() - 0.02) < 0.002


def test_causal():
    model = make()
    tokens = torch.randint(0, 97, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 97
    with torch.no_grad():
        assert torch.allclose(model(tokens)[:, :10], model(changed)[:, :10], atol=1e-6)
        assert not torch.allclose(model(tokens)[:, 10:], model(changed)[:, 10:])


def test_kv_cache_decoding_matches_full_forward():
    model = make()
    tokens = torch.randint(0, 97, (2, 20))
    cache = KVCache(
        n_layers=3,
        batch=2,
        n_kv_heads=2,
        head_dim=16,
        max_len=32,
        device="cpu",
        dtype=torch.float32,
    )
    with torch.no_grad():
        full = model(tokens)
        pieces = [model(tokens[:, :7], cache), model(tokens[:, 7:12], cache)]
        pieces += [model(tokens[:, i : i + 1], cache) for i in range(12, 20)]
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5)


def test_activation_checkpointing_gives_the_same_gradients():
    grads = {}
    for mode in ("none", "full", "selective"):
        cfg = JobConfig(model=TINY)
        cfg.train.activation_checkpointing = mode
        model = build_model(TINY)
        apply_parallelism(model, cfg)
        materialize(model, device="cpu", seed=0)
        tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
        model(tokens).logsumexp(-1).mean().backward()
        grads[mode] = [p.grad for p in model.parameters()]
    for mode in ("full", "selective"):
        for a, b in zip(grads["none"], grads[mode], strict=True):
            assert torch.allclose(a, b, atol=1e-6)
