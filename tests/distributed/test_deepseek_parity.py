"""Parity of the DeepSeek-V3 family: every layout its plan serves reproduces one process on the
debug DeepSeek model (multi-head latent attention with a low-rank query, a dense first block then
sigmoid-routed experts in groups with a shared expert, and one multi-token prediction depth),
step by step on loss, grad norm and every parameter's gradient norm within the parity tolerance
(fp32: only the reduction order differs).

The model has four blocks, so that interleaved pipeline stages get one each. Multi-token
prediction is on except under tensor, context and expert parallel, which it does not run with yet
(kiln/config/validate_deepseek.py): those run with model.mtp.depth = 0 against a reference of
their own."""

import pytest

from tests.distributed.parity import assert_parity, records

DEEPSEEK = ("--model.preset=deepseek_v3_debug", "--model.n_layers=4")
NO_MTP = (*DEEPSEEK, "--model.mtp.depth=0")
PP2 = ("--distributed.pp=2", "--distributed.pp_microbatches=2", "--train.batch_size=8")

LAYOUTS = {
    "dp_shard=2, MTP": (2, ["--distributed.dp_shard=2", "--train.batch_size=4"], DEEPSEEK),
    "dp_replicate=2 x dp_shard=2, full AC, MTP": (
        4,
        [
            "--distributed.dp_replicate=2",
            "--distributed.dp_shard=2",
            "--train.batch_size=2",
            "--train.activation_checkpointing=full",
        ],
        DEEPSEEK,
    ),
    "tp=2 x dp_shard=2": (4, ["--distributed.tp=2", "--train.batch_size=4"], NO_MTP),
    "pp=2 1f1b, MTP": (2, [*PP2, "--distributed.pp_schedule=1f1b"], DEEPSEEK),
    "pp=2 interleaved_1f1b, MTP": (
        2,
        [*PP2, "--distributed.pp_schedule=interleaved_1f1b", "--distributed.pp_virtual_stages=2"],
        DEEPSEEK,
    ),
    "ep=2": (2, ["--distributed.ep=2", "--train.batch_size=4"], NO_MTP),
    "ep=2 x tp=2": (
        4,
        ["--distributed.ep=2", "--distributed.tp=2", "--train.batch_size=4"],
        NO_MTP,
    ),
    "cp=2": (2, ["--distributed.cp=2", "--train.batch_size=8"], NO_MTP),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_deepseek_layout_matches_one_process(layout, references, runs):
    nproc, overrides, model = LAYOUTS[layout]
    got, expected = records(runs(nproc, *overrides, *model)), references(*model)
    assert_parity(got, expected)
    if "--model.mtp.depth=0" not in model:
        # The multi-token prediction loss is a mean over the same tokens in every layout.
        for step, record in expected.items():
            assert got[step]["mtp_loss_1"] == pytest.approx(record["mtp_loss_1"], rel=1e-5)
