"""A data mixture of two corpora with a phase, document masking and eval, trained by one process
and by two data-parallel ranks with gradient accumulation, and resumed from the two-rank
checkpoint by one process: the same losses (per dataset and held-out too) step by step."""

import json

import datasets
import pytest

from kiln.data.prepare import prepare_dataset
from tests.conftest import REPO
from tests.distributed.parity import (
    SAVE,
    STEPS,
    TOLERANCE,
    assert_parity,
    copy_to_resume,
    records,
)
from tests.distributed.workers import JobFailed

pytestmark = pytest.mark.slow

# The global batch of 8 sequences as one micro-batch, and as 2 ranks x 2 micro-batches of 2.
ONE_PROCESS = ["--train.batch_size=8"]
TWO_RANKS = ["--distributed.dp_shard=2", "--train.batch_size=2", "--train.grad_accum_steps=2"]


@pytest.fixture(scope="module")
def code_corpus(tmp_path_factory, demo_data):
    """kiln's own sources, tokenized with the demo corpus's tokenizer: a second corpus, unlike the
    demo one (the standard library), that a mixture can be made of."""
    folder = tmp_path_factory.mktemp("code_corpus")
    lines = [json.dumps({"text": f.read_text()}) for f in sorted((REPO / "kiln").rglob("*.py"))]
    (folder / "kiln.jsonl").write_text("\n".join(lines) + "\n")
    tokenizer = demo_data / "tokenizer.json"
    return prepare_dataset([folder / "kiln.jsonl"], tokenizer, folder / "kiln", num_workers=0)


def mixture_overrides(demo_data, code_corpus):
    mixture = (
        f'[{{name = "web", path = "{demo_data}", weight = 3.0}}, '
        f'{{name = "code", path = "{code_corpus}", weight = 1.0}}]'
    )
    return [
        f"--data.datasets={mixture}",
        "--data.phases=[{start_step = 6, weights = {code = 1.0}, lr_scale = 0.5}]",
        "--data.document_mask=true",
        "--data.num_workers=1",
        "--eval.interval=5",
        "--eval.steps=2",
        f"--eval.path={demo_data}",
    ]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, train, demo_data, code_corpus):
    run = tmp_path_factory.mktemp("data_reference") / "one"
    train(run, 1, *ONE_PROCESS, *mixture_overrides(demo_data, code_corpus))
    return records(run)


def assert_same_data_metrics(got, expected, steps):
    for step in steps:
        keys = [k for k in expected[step] if k.startswith(("loss/", "eval/"))]
        assert keys == [k for k in got[step] if k.startswith(("loss/", "eval/"))]
        for key in keys:
            a, b = got[step][key], expected[step][key]
            assert abs(a - b) <= TOLERANCE * abs(b), f"step {step} {key}: {a} vs {b}"


def test_mixture_two_ranks_then_resume_in_one(tmp_path, train, demo_data, code_corpus, one_process):
    overrides = mixture_overrides(demo_data, code_corpus)
    two = tmp_path / "two"
    train(two, 2, *TWO_RANKS, *overrides, SAVE)
    got = records(two)
    assert_parity(got, one_process)
    assert_same_data_metrics(got, one_process, steps=range(1, STEPS + 1))
    assert {"eval/loss", "eval/perplexity"} <= set(got[5])
    # Before the phase both datasets are read (not necessarily both in every step of 8).
    assert {"loss/web", "loss/code"} <= {key for step in range(1, 7) for key in got[step]}
    assert "loss/web" not in got[7]  # from step 6 the phase reads code only
    assert got[7]["lr"] < got[5]["lr"] * 0.75  # and halves the learning rate
    # Two corpora, not one under two names: the datasets' losses differ once the model has
    # learned a little (at step 1 both sit near ln(vocab), and the code corpus is kiln's own
    # sources, which change with every commit: one early step is no fixed margin).
    mixed = [step for step in range(1, 7) if {"loss/web", "loss/code"} <= set(got[step])]
    assert max(abs(got[step]["loss/web"] - got[step]["loss/code"]) for step in mixed) > 1e-2

    step_5 = copy_to_resume(two, tmp_path / "resumed")
    (output,) = train(tmp_path / "resumed", 1, *ONE_PROCESS, *overrides)
    assert f"kiln: resumed from {step_5} (step 5)" in output
    resumed = records(tmp_path / "resumed")
    assert_parity(resumed, one_process, steps=range(6, STEPS + 1))
    assert_same_data_metrics(resumed, one_process, steps=range(6, STEPS + 1))


def test_data_rank_0_cannot_prepare_fails_every_rank(tmp_path, train, demo_data):
    """Rank 0 tokenizes a Hugging Face dataset while the others wait: when it fails, they stop
    with its message instead of waiting at the barrier."""
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"content": ["def f():\n    pass\n"] * 8}).save_to_disk(saved)
    with pytest.raises(JobFailed) as failed:
        train(
            tmp_path / "run",
            2,
            "--data.source=hf",
            f"--data.path={saved}",
            f"--data.tokenizer={demo_data / 'tokenizer.json'}",
            "--data.text_key=text",
        )
    # Both ranks stopped with kiln's error exit, neither waited at the barrier; rank 0 says why.
    assert sorted(failed.value.errors) == [0, 1]
    assert all("exited with code 2" in error for error in failed.value.errors.values())
    assert "has no column 'text' (columns: content)" in failed.value.outputs[0]
