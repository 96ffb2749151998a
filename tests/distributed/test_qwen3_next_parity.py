"""Parity of the qwen3_next family: every parallelism its plan serves reproduces one process on
the debug Qwen3-Next model (Gated DeltaNet linear-attention layers and gated full attention, MoE
blocks with a gated shared expert), step by step on loss, grad norm, every parameter's gradient
norm and the MoE records within the parity tolerance (fp32: only the reduction order differs).

The fewest jobs that cover each parallelism once: HSDP with full activation checkpointing; tp=2
× ep=2 (the linear layers' heads split over tp, the experts over ep); Qwen3.5's dense blocks at
tp=2 in compiled blocks; cp=2 × pp=2 with selective activation checkpointing (the linear
layers' convolution inputs and states handed from chunk to chunk). Four blocks alternating
linear and full attention give each pipeline stage one of each, the stage boundary between a
full and a linear layer, and selective AC (even layers) a checkpointed linear layer and a full
one not. Document masking is on everywhere, so the linear layers' state and convolution restart
at each document in every layout (the runs' sequences cross documents: without the mask the
reference's A_log and dt_bias gradient norms differ by 2-24%).

The compiled job is the family's costliest (about 80 s on two cores with a cold compile cache:
two kinds of block, each compiled by both ranks); it carries tp and the dense blocks too.

The model's Switch load-balance loss takes its expert fractions from the counts of one
micro-batch (test_moe_parity.py), so the one reference runs the micro-batches every layout runs:
4 sequences × 2 accumulation steps (4 data ranks × 1 sequence, 2 data ranks × 2 sequences, and
the pipeline's 2 micro-batches of 4)."""

import pytest

from tests.distributed.parity import assert_parity, records, schedule
from tests.distributed.test_moe_parity import assert_moe_parity

QWEN3_NEXT = (
    "--model.preset=qwen3_next_debug",
    "--model.layer_types=['linear_attention', 'full_attention', 'linear_attention', "
    "'full_attention']",
    "--data.document_mask=true",
)
# Qwen3.5's dense blocks: the debug preset's MoE keys back at their defaults.
DENSE = (
    "--model.moe.num_experts=0",
    "--model.moe.shared_experts=0",
    "--model.moe.shared_expert_gate=false",
    "--model.moe.aux_loss_weight=0",
)
FOUR_BY_TWO = ("--train.batch_size=4", "--train.grad_accum_steps=2")

LAYOUTS = {
    "dp_replicate=2 x dp_shard=2, full AC": (
        4,
        [
            "--distributed.dp_replicate=2",
            "--distributed.dp_shard=2",
            "--train.batch_size=1",
            "--train.grad_accum_steps=2",
            "--train.activation_checkpointing=full",
        ],
    ),
    # 2 key heads and 4 value heads in the linear layers, 4 query and 2 KV heads in the full
    # ones: one key head with its 2 value heads and 2 query heads with one KV head per tp rank.
    "tp=2 x ep=2": (
        4,
        [
            "--distributed.tp=2",
            "--distributed.ep=2",
            "--train.batch_size=2",
            "--train.grad_accum_steps=2",
        ],
    ),
    # Qwen3.5's dense blocks (SwiGLU, split over tp like the attention's heads) in compiled
    # blocks: each kind of block traces with its tp-local parameters, and the chunked kernel's
    # eager pass from chunk to chunk (two chunks of 32 here) breaks the graph inside it.
    "tp=2, dense, compiled blocks": (
        2,
        [
            "--distributed.tp=2",
            "--train.batch_size=8",
            "--train.grad_accum_steps=1",
            "--train.compile=true",
            *DENSE,
        ],
    ),
    # Context parallel hands each linear layer's convolution inputs and state from chunk to
    # chunk (4 chunks of 16 tokens, head-tail: rank 0 holds chunks 0 and 3), through both
    # pipeline stages, a checkpointed linear layer recomputing its exchanges.
    "cp=2 x pp=2 1f1b, selective AC": (
        4,
        [
            "--distributed.cp=2",
            "--distributed.pp=2",
            *schedule("1f1b"),
            "--distributed.pp_microbatches=2",
            "--train.batch_size=8",
            "--train.grad_accum_steps=1",
            "--train.activation_checkpointing=selective",
        ],
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_qwen3_next_layout_matches_one_process(layout, runs):
    nproc, overrides = LAYOUTS[layout]
    got = records(runs(nproc, *overrides, *QWEN3_NEXT))
    if DENSE[0] in overrides:
        # Without a load-balance loss the micro-batches do not matter: the whole batch at once.
        expected = records(
            runs(1, "--train.batch_size=8", "--train.grad_accum_steps=1", *DENSE, *QWEN3_NEXT)
        )
        assert_parity(got, expected)
        return
    expected = records(runs(1, *FOUR_BY_TWO, *QWEN3_NEXT))
    assert_moe_parity(got, expected)
    # Every MoE layer is logged, so the MoE records have something to compare.
    assert len([k for k in expected[1] if k.startswith("moe/imbalance/")]) == 4
