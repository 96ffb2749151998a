"""Every optimizer gives the update of one process in every layout: Muon (its
Newton–Schulz on whole matrices, per expert for stacked experts, fp32 in fp32 runs), Lion and
Schedule-Free AdamW (elementwise on the local shards), compared
step by step on loss, gradient norm and every parameter's gradient norm, which from step 2 on
depend on the previous updates; and its state survives a save in one layout and a resume in
another."""

import pytest

from tests.distributed.parity import SAVE, STEPS, assert_parity, copy_to_resume, records

OPTIMIZERS = {
    "muon": (
        "--optimizer.name=muon",
        "--optimizer.lr=0.02",
        "--optimizer.adamw.lr=0.003",
        "--optimizer.adjust_lr=match_rms_adamw",
    ),
    "lion": (
        "--optimizer.name=lion",
        "--optimizer.lr=0.0005",
        "--optimizer.weight_decay=0.5",
        "--optimizer.betas=[0.9, 0.99]",
    ),
    # A save switches the weights to the evaluation point and back, which moves them by
    # rounding only (1e-7): the saving runs keep parity with the reference, which does not save.
    "schedule_free_adamw": (
        "--optimizer.name=schedule_free_adamw",
        "--scheduler.name=constant",
        "--scheduler.warmup_steps=3",
    ),
}
L4 = ("--model.n_layers=4",)
MOE = ("--model.preset=debug_moe",)

# name: (processes, overrides, model overrides of the layout and of its reference)
LAYOUTS = {
    # Saves checkpoints, which test_optimizer_state_resumes_in_another_layout continues.
    "dp_shard=2": (2, ["--distributed.dp_shard=2", "--train.batch_size=4", SAVE], ()),
    "tp=2 x dp_shard=2": (4, ["--distributed.tp=2", "--train.batch_size=4"], ()),
    "dp_replicate=2 x dp_shard=2": (
        4,
        ["--distributed.dp_replicate=2", "--distributed.dp_shard=2", "--train.batch_size=2"],
        (),
    ),
    "pp=2 1f1b": (
        2,
        ["--distributed.pp=2", "--distributed.pp_schedule=1f1b", "--train.batch_size=8"],
        L4,
    ),
    "moe, ep=2": (2, ["--distributed.ep=2", "--train.batch_size=4"], MOE),
}


def reference(runs, optimizer, model):
    return records(runs(1, "--train.batch_size=8", *OPTIMIZERS[optimizer], *model))


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_matches_one_process(optimizer, layout, runs):
    nproc, overrides, model = LAYOUTS[layout]
    got = records(runs(nproc, *overrides, *OPTIMIZERS[optimizer], *model))
    # TOLERANCE on any CPU, though Lion's sign and Muon's iteration could amplify the layouts'
    # last-bit differences: one process with every initial weight one ulp away (what another
    # CPU's reduction order leaves) stayed within 4e-7 of the reference at every step for
    # Lion (dense and MoE), Muon and Schedule-Free AdamW (test_float8's nudged worker).
    assert_parity(got, reference(runs, optimizer, model))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_state_resumes_in_another_layout(optimizer, runs, train, tmp_path):
    """Saved by the dp_shard=2 run at step 5, resumed at tp=2 × dp_shard=2 at step 6."""
    nproc, overrides, model = LAYOUTS["dp_shard=2"]
    run = tmp_path / "run"
    step_5 = copy_to_resume(runs(nproc, *overrides, *OPTIMIZERS[optimizer], *model), run)
    nproc, overrides, _ = LAYOUTS["tp=2 x dp_shard=2"]
    (output, *_) = train(run, nproc, *overrides, *OPTIMIZERS[optimizer], *model)
    assert f"kiln: resumed from {step_5} (step 5)" in output
    assert_parity(records(run), reference(runs, optimizer, model), steps=range(6, STEPS + 1))
