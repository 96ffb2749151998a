"""Parity of the DeepSeek-V3 family: every layout its plan serves reproduces one process on the
debug DeepSeek model (multi-head latent attention with a low-rank query, a dense first block then
sigmoid-routed experts in groups with a shared expert, and one multi-token prediction depth),
step by step on loss, grad norm and every parameter's gradient norm within the parity tolerance
(fp32: only the reduction order differs).

The model has four blocks, so that interleaved pipeline stages get one each. Multi-token
prediction is on in every layout: its depth is a block to every parallelism (split over tp like a
main block, its experts over ep, its tokens ahead read across cp chunks from the whole labels)."""

import pytest

from tests.distributed.parity import assert_parity, records

DEEPSEEK = ("--model.preset=deepseek_v3_debug", "--model.n_layers=4")
PP2 = ("--distributed.pp=2", "--distributed.pp_microbatches=2", "--train.batch_size=8")

LAYOUTS = {
    "dp_shard=2": (2, ["--distributed.dp_shard=2", "--train.batch_size=4"]),
    "dp_replicate=2 x dp_shard=2, full AC": (
        4,
        [
            "--distributed.dp_replicate=2",
            "--distributed.dp_shard=2",
            "--train.batch_size=2",
            "--train.activation_checkpointing=full",
        ],
    ),
    "tp=2 x dp_shard=2": (4, ["--distributed.tp=2", "--train.batch_size=4"]),
    "pp=2 1f1b": (2, [*PP2, "--distributed.pp_schedule=1f1b"]),
    "pp=2 interleaved_1f1b": (
        2,
        [*PP2, "--distributed.pp_schedule=interleaved_1f1b", "--distributed.pp_virtual_stages=2"],
    ),
    "ep=2": (2, ["--distributed.ep=2", "--train.batch_size=4"]),
    "ep=2 x tp=2": (
        4,
        ["--distributed.ep=2", "--distributed.tp=2", "--train.batch_size=4"],
    ),
    "cp=2": (2, ["--distributed.cp=2", "--train.batch_size=8"]),
    # MLA's keys (nope + rope wide) and values (narrower) travel the ring as one buffer.
    "cp=2 ring": (
        2,
        ["--distributed.cp=2", "--distributed.cp_mode=ring", "--train.batch_size=8"],
    ),
    # MLA's queries and keys (nope + rope wide) and values (narrower) each re-split over heads.
    "cp=2 all-to-all": (
        2,
        ["--distributed.cp=2", "--distributed.cp_mode=all_to_all", "--train.batch_size=8"],
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_deepseek_layout_matches_one_process(layout, references, runs):
    nproc, overrides = LAYOUTS[layout]
    got, expected = records(runs(nproc, *overrides, *DEEPSEEK)), references(*DEEPSEEK)
    assert_parity(got, expected)
    # The multi-token prediction loss is a mean over the same tokens in every layout (fp32, only
    # the reduction order differs).
    for step, record in expected.items():
        assert got[step]["mtp_loss_1"] == pytest.approx(record["mtp_loss_1"], rel=1e-5)
