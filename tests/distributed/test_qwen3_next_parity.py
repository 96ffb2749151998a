"""Parity of the qwen3_next family: every parallelism its plan serves reproduces one process on
the debug Qwen3-Next model (Gated DeltaNet linear-attention layers and gated full attention, MoE
blocks with a gated shared expert), step by step on loss, grad norm, every parameter's gradient
norm and the MoE records within the parity tolerance (fp32: only the reduction order differs).

The fewest jobs that cover each parallelism once: HSDP with full activation checkpointing; tp=2
× ep=2 (the linear layers' heads split over tp, the experts over ep); pp=2 with selective
activation checkpointing. Four blocks alternating linear and full attention give each pipeline
stage one of each, the stage boundary between a full and a linear layer, and selective AC (even
layers) a checkpointed linear layer and a full one not. Document masking is on everywhere, so
the linear layers' state and convolution restart at each document in every layout (the runs'
sequences cross documents: without the mask the reference's A_log and dt_bias gradient norms
differ by 2-24%).

Compiled blocks are left out: one cold compile of this family's blocks (the chunked kernel's
loop) made a compiled dp_shard=2 job take about 100 s on two cores; it matched one process.

The model's Switch load-balance loss takes its expert fractions from the counts of one
micro-batch (test_moe_parity.py), so the one reference runs the micro-batches every layout runs:
4 sequences × 2 accumulation steps (4 data ranks × 1 sequence, 2 data ranks × 2 sequences, and
the pipeline's 2 micro-batches of 4)."""

import pytest

from tests.distributed.parity import records, schedule
from tests.distributed.test_moe_parity import assert_moe_parity

QWEN3_NEXT = (
    "--model.preset=qwen3_next_debug",
    "--model.layer_types=['linear_attention', 'full_attention', 'linear_attention', "
    "'full_attention']",
    "--data.document_mask=true",
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
    "pp=2 1f1b, selective AC": (
        2,
        [
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
    expected = records(runs(1, *FOUR_BY_TWO, *QWEN3_NEXT))
    assert_moe_parity(got, expected)
    # Every MoE layer is logged, so the MoE records have something to compare.
    assert len([k for k in expected[1] if k.startswith("moe/imbalance/")]) == 4
