"""The batch ramp and the sequence-length phases (kiln/config/training_schedule.py): each step's
shape from the tokens read, what validation refuses, and resuming at another micro-batch."""

from __future__ import annotations

import pytest

from kiln.config import load_config, validate
from kiln.config.sections import BatchScheduleConfig, SeqLenPhase, TrainConfig
from kiln.config.training_schedule import StepShape, TrainingSchedule
from kiln.errors import ConfigError
from tests.conftest import DEBUG_CONFIG
from tests.unit.test_trainer import PHASE, RAMP, SCHEDULED, make_trainer


def walk(schedule: TrainingSchedule, steps: int) -> list[tuple[int, StepShape]]:
    """(tokens before the step, its shape) for steps 1..`steps`, one step at a time."""
    out, tokens = [], 0
    for _ in range(steps):
        out.append((tokens, schedule.shape_at(tokens)))
        tokens += out[-1][1].tokens(schedule.data_ranks)
    return out


def ramp(tokens, sequences, *, shape="linear", multiple_of=0, **train) -> TrainingSchedule:
    cfg = TrainConfig(
        batch_schedule=BatchScheduleConfig(tokens, sequences, shape, multiple_of), **train
    )
    return TrainingSchedule(cfg, data_ranks=1)


def test_the_linear_ramp_rounds_down_to_whole_micro_batches():
    """4 + 12 · t / 1000 sequences, rounded down to one micro-batch (2): exact integers."""
    schedule = ramp([0, 1000], [4, 16], seq_len=8, batch_size=2, grad_accum_steps=8)
    got = {t: schedule.batch_at(t) for t in (0, 166, 167, 499, 500, 999, 1000, 10**9)}
    assert got == {0: 4, 166: 4, 167: 6, 499: 8, 500: 10, 999: 14, 1000: 16, 10**9: 16}
    assert schedule.shape_at(499) == StepShape(micro_batches=4, batch_size=2, seq_len=8)
    steps = ramp([0, 1000, 3000], [4, 8, 16], shape="step", seq_len=8, batch_size=2,
                 grad_accum_steps=8)  # fmt: skip
    assert [steps.batch_at(t) for t in (0, 999, 1000, 2999, 3000)] == [4, 4, 8, 8, 16]


def test_a_layout_with_another_micro_batch_ramps_alike_under_multiple_of():
    """Rounded to `multiple_of` sequences, 4 data ranks of 1 sequence and 1 rank of 4 take the
    same batches: what makes a resume at another layout exact."""
    one = ramp([0, 1000], [8, 32], multiple_of=8, seq_len=8, batch_size=4, grad_accum_steps=8)
    four = TrainingSchedule(
        TrainConfig(
            seq_len=8,
            batch_size=1,
            grad_accum_steps=8,
            batch_schedule=BatchScheduleConfig([0, 1000], [8, 32], "linear", 8),
        ),
        data_ranks=4,
    )
    assert [one.batch_at(t) for t in range(0, 1200, 7)] == [
        four.batch_at(t) for t in range(0, 1200, 7)
    ]
    assert walk(one, 20) == [(t, StepShape(s.micro_batches, 4, 8)) for t, s in walk(four, 20)]


def test_phases_and_ramp_walk_the_run():
    """The schedule of SCHEDULED on one rank, step by step (each step's tokens in parentheses):
    phase 1 reads 4 sequences of 64 per micro-batch (the recipe's 2 × 128 tokens), the ramp holds
    one micro-batch until 2 + 2 · t / 1536 reaches 4 at t = 1536."""
    cfg = load_config(DEBUG_CONFIG, list(SCHEDULED), world_size=1).train
    schedule = TrainingSchedule(cfg, data_ranks=1)
    walked = walk(schedule, 8)
    assert [t for t, _ in walked] == [0, 256, 512, 768, 1024, 1280, 1536, 2048]
    assert [(s.micro_batches, s.batch_size, s.seq_len) for _, s in walked] == [
        *[(1, 4, 64)] * 3,
        *[(1, 2, 128)] * 3,
        *[(2, 2, 128)] * 2,
    ]
    assert schedule.total_tokens(8) == 2560
    assert schedule.describe(8) == [
        "steps 1-3: global batch 4 sequences of 64 tokens (1 micro-batch of 4 per data rank), "
        "tokens 0 to 768",
        "steps 4-6: global batch 2 sequences of 128 tokens (1 micro-batch of 2 per data rank), "
        "tokens 768 to 1,536",
        "steps 7-8: global batch 4 sequences of 128 tokens (2 micro-batches of 2 per data "
        "rank), tokens 1,536 to 2,560",
    ]


@pytest.mark.parametrize(
    ("points", "batches", "multiple", "phase"),
    [
        ([0, 1000], [4, 16], 2, None),
        ([0, 999, 5003], [2, 6, 32], 2, (4, 700)),
        ([0, 77], [6, 36], 6, (2, 5000)),
        ([0, 10, 20_000], [8, 8, 32], 8, None),
    ],
)
def test_the_phases_jump_to_what_a_step_by_step_walk_finds(points, batches, multiple, phase):
    """`phases` jumps from one change of shape to the next (a run of a million steps is a few
    phases, not a million shapes); grouping a walk of every step gives the same phases."""
    phases = [SeqLenPhase(seq_len=phase[0], until_tokens=phase[1])] if phase else []
    schedule = ramp(points, batches, multiple_of=multiple, seq_len=8, batch_size=2,
                    grad_accum_steps=batches[-1] // 2, seq_len_schedule=phases)  # fmt: skip
    grouped = []
    for step, (tokens, shape) in enumerate(walk(schedule, 400), start=1):
        if grouped and grouped[-1][-1] == shape:
            grouped[-1][1] = step
        else:
            grouped.append([step, step, tokens, shape])
    got = schedule.phases(400)
    assert [(p.first, p.last, p.tokens_from, p.shape) for p in got] == list(map(tuple, grouped))
    assert len(schedule.phases(10**12)) == len(got)  # the last phase just runs longer


BAD = {
    "the ramp does not reach the recipe's batch": (
        ["--train.batch_schedule.tokens=[0, 100]", "--train.batch_schedule.sequences=[2, 6]"],
        "sequences ends at 6, not the recipe's global batch",
    ),
    "the ramp goes down": (
        ["--train.batch_schedule.tokens=[0, 10, 20]", "--train.batch_schedule.sequences=[4, 2, 8]"],
        "goes down",
    ),
    "a batch of half a micro-batch": (
        ["--train.batch_schedule.tokens=[0, 10]", "--train.batch_schedule.sequences=[3, 8]"],
        "nearest valid ramp: sequences = [4, 8]",
    ),
    "token counts that do not start at 0": (
        ["--train.batch_schedule.tokens=[5, 10]", "--train.batch_schedule.sequences=[2, 8]"],
        "must start at 0",
    ),
    "a phase longer than train.seq_len": (
        ["--train.seq_len_schedule=[{seq_len=256, until_tokens=10}]"],
        "must be shorter than train.seq_len (128) and divide it",
    ),
    "a phase that cannot split across context parallel": (
        ["--distributed.cp=2", "--train.seq_len_schedule=[{seq_len=2, until_tokens=10}]"],
        "divisible by 2 × distributed.cp = 4",
    ),
    "a phase with more tokens per micro-batch than planned": (
        ["--train.seq_len_schedule=[{seq_len=64, until_tokens=10, batch_size=8}]"],
        "lower train.seq_len_schedule[0].batch_size to at most 4",
    ),
    "a phase whose pass does not split into the pipeline's micro-batches": (
        [
            "--distributed.pp=2",
            "--distributed.pp_microbatches=2",
            "--train.seq_len_schedule=[{seq_len=64, until_tokens=10, batch_size=3}]",
        ],
        "train.seq_len_schedule[0].batch_size = 3 (sequences per rank per pipeline pass) must "
        "be divisible by distributed.pp_microbatches = 2",
    ),
    "phases out of order": (
        ["--train.seq_len_schedule=[{seq_len=32, until_tokens=10}, {seq_len=64, until_tokens=5}]"],
        "must be positive and increase",
    ),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_schedules_are_refused_with_the_fix(case):
    overrides, fragment = BAD[case]
    world = 2 if {"--distributed.cp=2", "--distributed.pp=2"} & set(overrides) else 1
    micro_batches = ["--train.batch_size=2", "--train.grad_accum_steps=4"]
    cfg = load_config(DEBUG_CONFIG, [*micro_batches, *overrides])
    with pytest.raises(ConfigError) as refused:
        validate(cfg, world)
    assert fragment in str(refused.value)
    assert str(refused.value).count("\n  - ") <= 1  # one message for one mistake


def test_phases_run_under_pipeline_parallel():
    """Each phase's pass has a schedule of its own (kiln/parallel/forward_backward.py): pp_microbatches
    = 0 gives it one pipeline micro-batch per sequence, as the recipe's."""
    validate(load_config(DEBUG_CONFIG, ["--distributed.pp=2", *PHASE]), 2)


def test_learning_rate_over_tokens_is_over_steps_without_a_schedule(debug_overrides, tmp_path):
    """scheduler.unit = "tokens" without a ramp or phases: every step reads the full batch, so
    its schedule position is its step number exactly and the learning rates are equal."""
    steps = make_trainer(debug_overrides, "--train.max_steps=6")
    dirs = f"--metrics.run_dir={tmp_path / 'tokens'}"
    tokens = make_trainer(debug_overrides, dirs, "--train.max_steps=6", "--scheduler.unit=tokens")
    assert tokens.step_fn.lr_horizon == 6
    assert [steps.train_step().lr for _ in range(6)] == [tokens.train_step().lr for _ in range(6)]


def test_resume_at_another_micro_batch_needs_the_ramps_rounding(debug_overrides, tmp_path):
    """A ramped run resumed with another micro-batch (1 sequence × 4 instead of 2 × 2): the
    default rounding (one micro-batch on every data rank) would change, so the refusal names
    multiple_of; with it every step keeps its batch and the run goes on as uninterrupted."""
    run = [*RAMP, "--train.max_steps=8", "--train.grad_accum_steps=2", "--train.batch_size=2"]
    whole = make_trainer(debug_overrides, *run)
    expected = [whole.train_step().loss.item() for _ in range(8)]
    interrupted = [*run, f"--metrics.run_dir={tmp_path / 'interrupted'}"]
    first = make_trainer(debug_overrides, *interrupted)
    for _ in range(3):
        first.train_step()
    first.save()
    del first
    other = ["--train.batch_size=1", "--train.grad_accum_steps=4"]
    with pytest.raises(ConfigError) as refused:
        make_trainer(debug_overrides, *interrupted, *other)
    assert "pass --train.batch_schedule.multiple_of=2 to keep its steps" in str(refused.value)
    second = make_trainer(
        debug_overrides, *interrupted, *other, "--train.batch_schedule.multiple_of=2"
    )
    assert second.step == 3
    resumed = [second.train_step().loss.item() for _ in range(5)]
    # fp32, the same samples in each step summed as 4 micro-batches of 1 instead of 2 of 2:
    # another order of the same additions, about 1e-7 relative apart; a wrong batch is 1e-2.
    assert resumed == pytest.approx(expected[3:], rel=1e-5)
