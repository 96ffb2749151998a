"""Context parallel's pieces in one process: the head-tail split, RoPE and the mask at global
positions, and the errors for what it cannot take. Parity over real cp ranks is in
tests/distributed/test_context_parallel.py."""

import dataclasses

import pytest
import torch

from kiln.cli import main
from kiln.config import JobConfig, ModelConfig
from kiln.config.sections import DistributedConfig, TrainConfig
from kiln.config.validate import collect_problems
from kiln.model import build_model, materialize
from kiln.model.document_mask import (
    build_document_mask,
    build_position_mask,
    document_ids,
    masked_attention,
)
from kiln.model.kv_cache import KVCache
from kiln.model.llama.plan import llama_plan
from kiln.parallel.context_parallel import check_context_parallel, load_balanced_positions

MODEL = ModelConfig(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden_dim=96, max_seq_len=64
)
quiet_flex = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def test_head_tail_split_gives_every_rank_an_early_and_a_late_chunk():
    assert load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    parts = [load_balanced_positions(64, 4, rank) for rank in range(4)]
    assert sorted(torch.cat(parts).tolist()) == list(range(64))
    # Causal work (keys each query sees) is the same on every rank.
    assert len({int((part + 1).sum()) for part in parts}) == 1


def whole_and_split_logits(*, masked: bool, positions_given: bool = True):
    """Logits of one process on whole sequences, and on the same tokens in the order cp=4 ranks
    hold them (each rank's chunks, rank after rank) with their global positions."""
    model = materialize(build_model(MODEL), device="cpu", seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL.vocab_size, (2, 64), generator=gen)
    tokens[:, 10::13] = 0  # EOS: documents of 13 tokens
    order = torch.cat([load_balanced_positions(64, 4, rank) for rank in range(4)])
    ids = document_ids(tokens, 0)
    kwargs = {"document_ids": ids[:, order]} if masked else {}
    if positions_given:
        kwargs["positions"] = order.expand(2, -1)
    with torch.no_grad():
        whole = model(tokens, document_ids=ids if masked else None)
        split = model(tokens[:, order], **kwargs)
    return whole[:, order], split


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "document mask"])
def test_tokens_at_their_global_positions_give_the_whole_sequence_logits(masked):
    whole, split = whole_and_split_logits(masked=masked)
    assert (whole - split).abs().max() <= 1e-5


def test_without_the_positions_the_reordered_tokens_give_other_logits():
    """At init attention moves the logits little: still hundreds of times the tolerance."""
    whole, split = whole_and_split_logits(masked=False, positions_given=False)
    assert (whole - split).abs().max() > 100 * 1e-5


def test_position_mask_in_order_is_the_document_mask():
    ids = document_ids(torch.tensor([[5, 0, 3, 4, 0, 2, 2, 9]]), 0)
    positions = torch.arange(8)[None]
    mask = build_position_mask(positions, positions, ids=ids, key_ids=ids, kernel="sdpa")
    assert torch.equal(mask, build_document_mask(ids, "sdpa"))


@quiet_flex
def test_flex_position_mask_matches_sdpa():
    """Queries of one cp rank (2 of 4 chunks of 256) over every key, in rank order."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 128, 16, generator=gen)
    k, v = (torch.randn(1, 2, 256, 16, generator=gen) for _ in range(2))
    positions = load_balanced_positions(256, 2, 1)[None]
    keys = torch.cat([load_balanced_positions(256, 2, r) for r in range(2)])[None]
    ids, key_ids = positions // 50, keys // 50
    outputs = [
        masked_attention(
            q, k, v, build_position_mask(positions, keys, ids=ids, key_ids=key_ids, kernel=kernel)
        )
        for kernel in ("sdpa", "flex")
    ]
    assert (outputs[0] - outputs[1]).abs().max() <= 1e-5


def test_positions_with_a_kv_cache_are_refused():
    model = materialize(build_model(MODEL), device="cpu", seed=0)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="KV cache"):
        cache = KVCache(
            n_layers=2, batch=1, n_kv_heads=2, head_dim=16, max_len=8, device="cpu", dtype=None
        )
        model(tokens, cache, positions=torch.arange(4)[None])


def test_a_plan_without_attention_layers_cannot_take_context_parallel():
    model = build_model(MODEL)
    without = dataclasses.replace(llama_plan(MODEL), block_attention=lambda block: ())
    with pytest.raises(ValueError, match=r"set distributed\.cp = 1"):
        check_context_parallel(model, without)


def layout(cp: int, tp: int, seq_len: int) -> JobConfig:
    return JobConfig(
        model=MODEL, train=TrainConfig(seq_len=seq_len), distributed=DistributedConfig(cp=cp, tp=tp)
    )


def test_seq_len_must_split_into_two_chunks_per_cp_rank():
    problems = collect_problems(layout(cp=4, tp=1, seq_len=60), world_size=4)
    assert any("2 × distributed.cp = 8" in p and "56 or 64" in p for p in problems), problems
    assert not collect_problems(layout(cp=4, tp=1, seq_len=64), world_size=4)


def test_each_cp_ranks_tokens_must_split_over_tp():
    problems = collect_problems(layout(cp=2, tp=4, seq_len=36), world_size=8)
    assert any("18 tokens" in p and "divisible by 8" in p for p in problems), problems
    assert not collect_problems(layout(cp=2, tp=2, seq_len=64), world_size=4)


def test_kiln_check_describes_the_split(capsys):
    # The recipe at cp = 4 with the all-gather and full checkpointing (it ships cp = 8 with the
    # all-to-all, the planner's choice).
    args = [
        *["check", "llama3_8b_128k_32gpu", "--world-size", "32", "--config-only"],
        *["--distributed.cp=4", "--distributed.cp_mode=all_gather"],
        "--train.activation_checkpointing=full",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "dp_shard=8 × cp=4" in out
    assert "each rank holds 32,768 of every 131,072 tokens (chunks 16,384 long" in out
    # 2 (k, v) × 131072 tokens × 8 KV heads × 128 × 2 bytes = 512 MiB, 3/4 of it gathered.
    assert "all-gathers 384.0 MiB of keys and values, the whole sequence's 512.0 MiB" in out
    assert "a checkpointed layer gathers them again when it is recomputed" in out
    assert main([*args, "--distributed.cp_mode=ring"]) == 0
    out = capsys.readouterr().out
    # A block is a quarter of the 512 MiB; backward sends the 3 again and 4 fp32 gradients of
    # 256 MiB. Kept: 32,768 tokens × 4096 outputs in bf16; in flight: 2 blocks and 2 gradients.
    assert "3 sends of a 128.0 MiB block (384.0 MiB)" in out
    assert "1,408.0 MiB in backward" in out
    assert "one more copy of its own tokens' output (256.0 MiB" in out
    assert "768.0 MiB in backward" in out
    # Attention's forward, 32 layers × 131,072 / 2 keys × 32 heads × 256 × 2 = 3.4e10 a token,
    # over the model's 6 × 7.5e9 matmul + 3 × 3.4e10 attention, × 4/3 for full checkpointing.
    assert "17% more FLOPs here" in out
