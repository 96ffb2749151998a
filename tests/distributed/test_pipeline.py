"""Pipeline parallel reproduces one process: every schedule at pp=2 and pp=4, composed
with tensor parallel, FSDP, activation checkpointing, gradient accumulation and tied embeddings,
and checkpoints that move between pipelined and unpipelined layouts."""

import pytest

from tests.distributed.parity import (
    GLOBAL_BATCH,
    SAVE,
    STEPS,
    TOLERANCE,
    VIRTUAL_STAGES,
    WINDOWED,
    assert_parity,
    copy_to_resume,
    records,
    reference_args,
    schedule,
)
from tests.distributed.test_parity import QWEN3
from tests.distributed.workers import JobFailed

# Four layers: one per stage at pp=2 with two virtual stages per rank, and at pp=4 with one.
# Eight where pp=4 runs two virtual stages per rank. Every tensor-parallel and FSDP collective is
# per layer, so the smaller model halves what the pp=2 runs spend (24.9 s -> 14.9 s for
# pp=2 x tp=2 x dp_shard=2, benchmarks/test_suite.md).
L4 = ("--model.n_layers=4",)
L8 = ("--model.n_layers=8",)
# Tied embeddings make steps 4-5 ill-conditioned: summing the batch's gradient as one batch of 8
# or as 8 micro-batches of 1 moves the grad norm by 1e-5 even in one process. Pipelined runs
# split the batch into single-sequence micro-batches, so tied runs compare with a one-process run
# that does too (gradient accumulation over 8 sequences): then they agree to 1e-7.
TIED2 = ("--model.n_layers=2", "--model.tie_embeddings=true")
TIED4 = ("--model.n_layers=4", "--model.tie_embeddings=true")
# Qwen3-shaped (test_parity.py's QWEN3: a head width of its own, q/k norms, tied, lr 1e-3), 2 layers.
QWEN3_TIED2 = ("--model.n_layers=2", *QWEN3)
PER_SEQUENCE = ("--train.batch_size=1", "--train.grad_accum_steps=8")
# Those ill-conditioned steps also move the per-parameter norms of tied runs past 1e-5 (up to
# 4.7e-5 measured on zbv, step 6, layers.0.attention.wk.weight); loss and global gradient norm
# keep 1e-5, and a real mistake moves a per-parameter norm by 10% or more (test_mutations.py).
TIED_PARAM_TOLERANCE = 1e-4
M2 = "--distributed.pp_microbatches=2"
# A batch ramp (docs/configuration.md) from one micro-batch of 4 sequences over the data ranks to
# two, at step 7, after two sequence-length phases, 16 tokens at step 1 and 32 at steps 2-5: the
# one process it matches accumulates 2 × 4; the layout's own batch settings come after these and
# win. The pipelined layout's passes take three shapes (8 sequences of 16 per rank in 8 pipeline
# micro-batches, 4 of 32 in 4, 2 of 64 in 2), each with a schedule of its own; the held-out
# evaluation at step 5 (`held_out`) runs at the recipe's shape mid-phase: the first phase's
# schedule is dropped (two are kept) and the recipe's, built for evaluation, then trains.
RAMP = (
    *L4,
    "--train.batch_size=4",
    "--train.grad_accum_steps=2",
    "--train.batch_schedule.tokens=[0, 1536]",
    "--train.batch_schedule.sequences=[4, 8]",
    "--train.seq_len_schedule=[{seq_len=16, until_tokens=256}, {seq_len=32, until_tokens=1280}]",
    "--scheduler.unit=tokens",
)
MASKED = (*L4, "--data.document_mask=true")
# Each stage builds its layers' masks, one per window (parity.py's WINDOWED on four layers).
MASKED_WINDOWED = (
    *MASKED,
    *WINDOWED,
    "--model.layer_types=['sliding_attention', 'full_attention', 'sliding_attention', "
    "'full_attention']",
)

LAYOUTS = {
    **{
        f"pp={pp} {name}": (
            pp,
            [f"--distributed.pp={pp}", *schedule(name)],
            L8 if pp * VIRTUAL_STAGES[name] > 4 else L4,
        )
        for pp in (2, 4)
        for name in VIRTUAL_STAGES
    },
    # Tensor-parallel collectives over gloo dominate these runs: 2 micro-batches keep them short.
    "pp=2 x tp=2": (4, ["--distributed.pp=2", "--distributed.tp=2", M2], L4),
    # Saves checkpoints: test_pipelined_checkpoint_resumes_in_one_process continues them.
    "pp=2 x dp_shard=2": (4, ["--distributed.pp=2", "--train.batch_size=4", SAVE], L4),
    "pp=2 x HSDP (dp_replicate=2)": (
        4,
        [
            "--distributed.pp=2",
            "--distributed.dp_replicate=2",
            "--distributed.dp_shard=1",
            "--train.batch_size=4",
        ],
        L4,
    ),
    "pp=2 x tp=2 x dp_shard=2": (
        8,
        ["--distributed.pp=2", "--distributed.tp=2", "--train.batch_size=4", M2],
        L4,
    ),
    "pp=2 zbv x dp_shard=2, selective AC": (
        4,
        [
            "--distributed.pp=2",
            *schedule("zbv"),
            "--train.batch_size=4",
            "--train.activation_checkpointing=selective",
        ],
        L4,
    ),
    "pp=2 x dp_shard=2, full AC, 2 micro-batches x accum 2, batch ramp and phase": (
        4,
        [
            "--distributed.pp=2",
            "--train.batch_size=2",
            "--train.grad_accum_steps=2",
            "--train.activation_checkpointing=full",
        ],
        RAMP,
    ),
    "pp=2, explicit split 1+3, 2 micro-batches": (
        2,
        [
            "--distributed.pp=2",
            "--distributed.pp_layers_per_stage=[1, 3]",
            "--distributed.pp_microbatches=2",
        ],
        L4,
    ),
    "pp=2, Qwen3-shaped (tied embeddings)": (2, ["--distributed.pp=2"], QWEN3_TIED2),
    "pp=2 x tp=2, tied embeddings": (
        4,
        ["--distributed.pp=2", "--distributed.tp=2", M2],
        TIED2,
    ),
    "pp=2 x dp_shard=2, tied embeddings": (
        4,
        ["--distributed.pp=2", "--train.batch_size=4"],
        TIED2,
    ),
    "pp=2 zbv, tied embeddings on one rank": (2, ["--distributed.pp=2", *schedule("zbv")], TIED4),
    # Every stage builds the document mask from the tokens: keyword arguments of the schedule.
    "pp=2 1f1b, document mask, sliding window and sinks": (
        2,
        ["--distributed.pp=2", *schedule("1f1b")],
        MASKED_WINDOWED,
    ),
    "pp=2 interleaved_1f1b x dp_shard=2, document mask": (
        4,
        ["--distributed.pp=2", *schedule("interleaved_1f1b"), "--train.batch_size=4"],
        MASKED,
    ),
}


def layout_run(runs, layout, *extra):
    nproc, overrides, model = LAYOUTS[layout]
    batch = (
        [] if any("batch_size" in o for o in overrides) else [f"--train.batch_size={GLOBAL_BATCH}"]
    )
    return runs(nproc, *batch, *model, *extra, *overrides)


def held_out(demo_data) -> tuple[str, ...]:
    """Held-out loss at steps 5 (in the second phase, at the recipe's shape) and 10."""
    return ("--eval.interval=5", "--eval.steps=1", f"--eval.path={demo_data}")


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_pipeline_matches_one_process(layout, references, runs, demo_data):
    model = LAYOUTS[layout][2]
    tied = "--model.tie_embeddings=true" in model
    extra = held_out(demo_data) if model is RAMP else ()
    expected = references(*model, *extra, *(PER_SEQUENCE if tied else ()))
    tolerance = TIED_PARAM_TOLERANCE if tied else TOLERANCE
    got = records(layout_run(runs, layout, *extra))
    assert_parity(got, expected, param_tolerance=tolerance)
    for step in (5, 10) if extra else ():
        # fp32, the same sequences summed in another order over ranks and micro-batches.
        assert got[step]["eval/loss"] == pytest.approx(expected[step]["eval/loss"], rel=TOLERANCE)


def test_pipelined_checkpoint_resumes_in_one_process(references, runs, train, tmp_path):
    """Saved by pp=2 × dp_shard=2 stages (each rank writes its layers), resumed unpipelined."""
    run = tmp_path / "run"
    step_5 = copy_to_resume(layout_run(runs, "pp=2 x dp_shard=2"), run)
    assert len(list(step_5.glob("*.distcp"))) == 4
    (output,) = train(run, 1, f"--train.batch_size={GLOBAL_BATCH}", *L4)
    assert f"kiln: resumed from {step_5} (step 5)" in output
    assert_parity(records(run), references(*L4), steps=range(6, STEPS + 1))


def test_one_process_checkpoint_resumes_pipelined(references, runs, train, tmp_path):
    """Saved by one process (the reference run), resumed by pp=2 × tp=2 with interleaved
    virtual stages."""
    run = tmp_path / "run"
    step_5 = copy_to_resume(runs(*reference_args(*L4)), run)
    pipelined = ["--distributed.pp=2", "--distributed.tp=2", *schedule("interleaved_1f1b")]
    outputs = train(run, 4, *pipelined, f"--train.batch_size={GLOBAL_BATCH}", M2, *L4)
    assert f"kiln: resumed from {step_5} (step 5)" in outputs[0]
    assert_parity(records(run), references(*L4), steps=range(6, STEPS + 1))


def test_bad_schedule_settings_fail_on_every_rank_before_any_process_group(train, tmp_path):
    """zbv with one stage per rank: every rank stops with kiln's error exit before it sets up a
    process group, none waits on the others; rank 0 says why."""
    with pytest.raises(JobFailed) as failed:
        train(tmp_path / "run", 2, "--distributed.pp=2", "--distributed.pp_schedule=zbv")
    assert sorted(failed.value.errors) == [0, 1]
    for error in failed.value.errors.values():
        assert "exited with code 2" in error and "process group is up" not in error, error
    assert "set pp_virtual_stages = 2" in failed.value.outputs[0]
    assert not (tmp_path / "run").exists()
