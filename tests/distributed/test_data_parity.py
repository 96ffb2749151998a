"""A data mixture with a phase, document masking and eval, trained by one process and by two
data-parallel ranks with gradient accumulation, and resumed from the two-rank checkpoint by one process: the same losses
(per dataset and held-out too) step by step."""

import subprocess
import sys

import datasets
import pytest

from tests.distributed.parity import (
    TOLERANCE,
    assert_parity,
    env,
    keep_only_first_checkpoint,
    records,
    train,
    train_args,
)

pytestmark = pytest.mark.slow

# The global batch of 8 sequences as one micro-batch, and as 2 ranks x 2 micro-batches of 2.
ONE_PROCESS = ["--train.batch_size=8"]
TWO_RANKS = ["--distributed.dp_shard=2", "--train.batch_size=2", "--train.grad_accum_steps=2"]


def mixture_overrides(demo_data):
    datasets = (
        f'[{{name = "web", path = "{demo_data}", weight = 3.0}}, '
        f'{{name = "code", path = "{demo_data}", weight = 1.0}}]'
    )
    return [
        f"--data.datasets={datasets}",
        "--data.phases=[{start_step = 6, weights = {code = 1.0}, lr_scale = 0.5}]",
        "--data.document_mask=true",
        "--data.num_workers=1",
        "--eval.interval=5",
        "--eval.steps=2",
        f"--eval.path={demo_data}",
    ]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, demo_data):
    base = tmp_path_factory.mktemp("data_reference")
    return records(train(base, "one", demo_data, 1, *ONE_PROCESS, *mixture_overrides(demo_data)))


def assert_same_data_metrics(got, expected, steps):
    for step in steps:
        keys = [k for k in expected[step] if k.startswith(("loss/", "eval/"))]
        assert keys == [k for k in got[step] if k.startswith(("loss/", "eval/"))]
        for key in keys:
            a, b = got[step][key], expected[step][key]
            assert abs(a - b) <= TOLERANCE * abs(b), f"step {step} {key}: {a} vs {b}"


def test_mixture_two_ranks_then_resume_in_one(tmp_path, demo_data, one_process):
    overrides = mixture_overrides(demo_data)
    two = train(tmp_path, "two", demo_data, 2, *TWO_RANKS, *overrides)
    got = records(two)
    assert_parity(got, one_process)
    assert_same_data_metrics(got, one_process, steps=range(1, 11))
    assert {"eval/loss", "eval/perplexity"} <= set(got[5])
    # Before the phase both datasets are read (not necessarily both in every step of 8).
    assert {"loss/web", "loss/code"} <= {key for step in range(1, 7) for key in got[step]}
    assert "loss/web" not in got[7]  # from step 6 the phase reads code only
    assert got[7]["lr"] < got[5]["lr"] * 0.75  # and halves the learning rate

    keep_only_first_checkpoint(two)
    resumed = records(train(tmp_path, "two", demo_data, 1, *ONE_PROCESS, *overrides))
    assert_parity(resumed, one_process, steps=range(6, 11))
    assert_same_data_metrics(resumed, one_process, steps=range(6, 11))


def test_data_rank_0_cannot_prepare_fails_every_rank(tmp_path, demo_data):
    """Rank 0 tokenizes a Hugging Face dataset while the others wait: when it fails, they stop
    with its message instead of waiting at the barrier."""
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"content": ["def f():\n    pass\n"] * 8}).save_to_disk(saved)
    args = train_args(
        tmp_path / "run",
        demo_data,
        "--data.source=hf",
        f"--data.path={saved}",
        f"--data.tokenizer={demo_data / 'tokenizer.json'}",
        "--data.text_key=text",
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    result = subprocess.run(
        [*command, "-m", "kiln", "train", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env(),
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "has no column 'text' (columns: content)" in output
    assert "rank 0 could not prepare the training data" in output
