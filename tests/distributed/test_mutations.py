"""The parity checks have teeth: each test installs one deliberate mistake (tests/support/mutations.py)
for one job and shows which check catches it, and at which step. The jobs stop after three steps
of the ten-step schedule of the reference (train.stop_at_step): the mistakes show at step 1."""

import pytest

from tests.distributed.parity import assert_parity, mismatches, records
from tests.distributed.workers import JobFailed
from tests.support.mutations import warning

STEPS = 3


def mutated(train, run_dir, nproc, mutation, *overrides):
    train(run_dir, nproc, *overrides, f"--train.stop_at_step={STEPS}", mutation=mutation)
    return records(run_dir)


def test_unreduced_norm_gradients_are_caught_only_by_the_per_parameter_norms(
    reference, train, tmp_path
):
    """tp=2 with the sequence-parallel norm weights keeping each tp rank's partial gradient. The
    forward is untouched and those weights hold a sliver of the gradient, so at step 1 the loss
    and the global gradient norm still match one process within the tolerance: the check of
    loss and grad_norm alone passes that step. The per-parameter norms flag exactly the norm
    weights at once."""
    layout = ("--distributed.tp=2", "--train.batch_size=8")
    got = mutated(train, tmp_path / "run", 2, "unreduced_sp_norm_grads", *layout)
    first = mismatches(got[1], reference[1])
    assert "loss" not in first and "grad_norm" not in first, first
    assert first and all(key.endswith("norm.weight") for key in first), first
    with pytest.raises(AssertionError, match=r"(?s)step 1: .*norm\.weight"):
        assert_parity(got, reference, steps=range(1, STEPS + 1))


@pytest.mark.parametrize(
    ("mutation", "nproc", "layout"),
    [
        ("average_gradients", 2, ["--distributed.dp_shard=2", "--train.batch_size=4"]),
        ("pp_scale_grads", 2, ["--distributed.pp=2", "--model.n_layers=4"]),
    ],
    ids=["gradients averaged over dp_shard=2", "pipeline gradients scaled twice"],
)
def test_wrongly_scaled_gradients_are_caught_at_the_first_step(
    mutation, nproc, layout, references, train, tmp_path
):
    """Every gradient off by a constant factor: the loss of step 1 is right, its gradient norm
    and every parameter's norm are not."""
    model = [o for o in layout if o.startswith("--model.")]
    batch = [] if any("batch_size" in o for o in layout) else ["--train.batch_size=8"]
    got = mutated(train, tmp_path / "run", nproc, mutation, *batch, *layout)
    expected = references(*model)
    first = mismatches(got[1], expected[1])
    assert "loss" not in first and "grad_norm" in first, first
    assert {f"param_grad_norms/{name}" for name in expected[1]["param_grad_norms"]} <= set(first)
    with pytest.raises(AssertionError, match="step 1: "):
        assert_parity(got, expected, steps=range(1, STEPS + 1))


def test_fsdp_before_tensor_parallel_fails_the_job(train, tmp_path):
    """FSDP applied before tensor parallel: the layout cannot even run a step."""
    with pytest.raises(JobFailed) as failed:
        train(
            tmp_path / "run",
            4,
            "--distributed.tp=2",
            "--train.batch_size=4",
            mutation="fsdp_before_tp",
        )
    assert all(warning("fsdp_before_tp") in output for output in failed.value.outputs)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
