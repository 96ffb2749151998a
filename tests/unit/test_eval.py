"""`kiln eval` and lm-evaluation-harness (issue 20): the kiln adapter scores tiny local tasks
exactly as the harness's own Hugging Face model does on the same weights exported with `kiln
convert kiln-to-hf`; the held-out perplexity is the mean token loss computed directly; bad input
is one clear error; `[eval] tasks` scores the training model and logs the scores."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.checkpoint import load_checkpoint, read_model_config, resolve_checkpoint
from kiln.cli import main
from kiln.config import load_config
from kiln.data.tokenizer import load_tokenizer
from kiln.errors import ConfigError
from kiln.eval.tasks import OFFLINE_VARIABLES
from kiln.metrics.logger import read_metrics
from kiln.model import build_model, materialize
from tests.conftest import DEBUG_CONFIG
from tests.eval_tasks import CONTEXT, LONG, TASKS, TEXTS, write_checkpoint, write_tasks

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

# Log-likelihoods summed over a continuation, kiln's against transformers' fp32 logits (their
# logits agree to 1e-5, tests/unit/test_hf_convert.py); the metrics derived from them (the
# perplexities, bits per byte) are compared at the same relative tolerance.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    ckpt = write_checkpoint(root)
    assert main(["convert", "kiln-to-hf", str(ckpt), str(root / "hf")]) == 0
    return {"ckpt": ckpt, "hf": root / "hf", "tasks": write_tasks(root / "tasks"), "root": root}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _samples(results: dict) -> dict[str, list]:
    return {task: [s["resps"] for s in samples] for task, samples in results["samples"].items()}


def test_kiln_adapter_scores_like_the_harness_hf_model(tiny):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from kiln.eval.harness import KilnCheckpointLM
    from kiln.eval.tasks import run_tasks

    manager = TaskManager(include_path=str(tiny["tasks"]), include_defaults=False)
    kiln_lm = KilnCheckpointLM(checkpoint=str(tiny["ckpt"]), batch_size=3, device="cpu")
    ours = run_tasks(kiln_lm, manager, TASKS, log_samples=True)
    # The harness's own model on the export; kiln's streams start a document after <|eos|>, so
    # the empty-context token is eos for both (HFLM would take the exported <|bos|>).
    hf_lm = HFLM(
        pretrained=str(tiny["hf"]),
        device="cpu",
        dtype="float32",
        batch_size=3,
        prefix_token_id=kiln_lm.eot_token_id,
    )
    theirs = simple_evaluate(
        model=hf_lm, tasks=TASKS, task_manager=manager, bootstrap_iters=0, log_samples=True
    )
    assert hf_lm.max_length == kiln_lm.max_length == CONTEXT

    for task in TASKS:
        for key, value in theirs["results"][task].items():
            if isinstance(value, float):
                assert math.isclose(ours["results"][task][key], value, rel_tol=TOLERANCE), key
    ours, theirs = _samples(ours), _samples(theirs)
    # Each choice's (log-likelihood, greedy); each text's rolling log-likelihood; each generation.
    got, want = (
        [choice[0] for sample in samples["tiny_choice"] for choice in sample]
        for samples in (ours, theirs)
    )
    np.testing.assert_allclose([g for g, _ in got], [w for w, _ in want], rtol=0, atol=TOLERANCE)
    assert [greedy for _, greedy in got] == [greedy for _, greedy in want]
    np.testing.assert_allclose(
        [sample[0][0] for sample in ours["tiny_perplexity"]],
        [sample[0][0] for sample in theirs["tiny_perplexity"]],
        rtol=0,
        atol=TOLERANCE,
    )
    assert ours["tiny_generation"] == theirs["tiny_generation"]
    # The stop sequences mattered: unstopped, the first question's continuation runs past one.
    prompt = kiln_lm.tok_encode("Q: what fires clay?\nA:")
    unstopped = kiln_lm.runner.greedy(prompt, max_new_tokens=12, stop=lambda new: False)
    text = kiln_lm.tok_decode(unstopped)
    assert "e" in text and ours["tiny_generation"][0] == [[text.split("\n")[0].split("e")[0]]]


def test_kiln_eval_perplexity_is_the_mean_token_loss(tiny, tmp_path):
    text = tmp_path / "held_out.txt"
    text.write_text(" ".join(TEXTS * 6))
    out = tmp_path / "eval.json"
    args = ["eval", str(tiny["ckpt"]), "--data", str(text), "--seq-len", "16", "--batch-size", "2"]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())

    # Directly: the text's tokens and eos (a document), cut into samples of 16 + 1 tokens.
    tokenizer = load_tokenizer(tiny["root"] / "tokenizer.json")
    tokens = tokenizer.encode(text.read_text(), add_special_tokens=False).ids
    tokens.append(tokenizer.token_to_id("<|eos|>"))
    samples = len(tokens[:-1]) // 16 // 2 * 2  # whole batches of 2
    assert result["samples"] == samples and result["seq_len"] == 16
    rows = torch.tensor([tokens[i * 16 : i * 16 + 17] for i in range(samples)])
    step_dir = resolve_checkpoint(tiny["ckpt"])
    model = materialize(build_model(read_model_config(step_dir)), device="cpu", seed=None)
    load_checkpoint(step_dir, model=model)
    with torch.no_grad():
        logits = model(rows[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()
    assert result["eval/loss"] == pytest.approx(loss, rel=1e-6)
    assert result["eval/perplexity"] == pytest.approx(math.exp(loss), rel=1e-6)


def test_kiln_eval_tasks_from_the_command_line(tiny, tmp_path, capsys):
    out = tmp_path / "tasks.json"
    args = ["eval", str(tiny["ckpt"]), "--tasks", ",".join(TASKS)]
    args += ["--include-path", str(tiny["tasks"]), "--limit", "2", "--bootstrap-iters", "0"]
    assert main([*args, "--json", str(out)]) == 0
    scores = json.loads(out.read_text())["scores"]
    assert {"eval/tiny_choice/acc", "eval/tiny_perplexity/bits_per_byte"} <= scores.keys()
    assert "|tiny_choice" in capsys.readouterr().out  # the harness's table


def test_an_unknown_task_is_one_error(tiny, capsys):
    args = [
        "eval",
        str(tiny["ckpt"]),
        "--tasks",
        "tiny_choise",
        "--include-path",
        str(tiny["tasks"]),
    ]
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    (error,) = [line for line in lines if "error:" in line]  # one line, beside which step it read
    assert "'tiny_choise' (did you mean 'tiny_choice'?)" in error and "lm-eval ls tasks" in error
    assert len(lines) == 2 and "evaluating" in lines[0]


# A task whose dataset lives on the Hub and in no cache.
HUB_TASK = """task: hub_only
dataset_path: kiln-test/absent-from-every-cache
output_type: multiple_choice
test_split: test
doc_to_text: "{{question}}"
doc_to_target: 0
doc_to_choice: ["a", "b"]
"""


def test_an_unreachable_hub_fails_at_once_and_says_how_to_fix_it(
    tiny, tmp_path, monkeypatch, capsys
):
    """Without network the datasets library retries every file for tens of seconds and then
    fails without a fix. A Hub that does not answer (here a closed loopback port, never the
    internet) switches kiln to the local cache, and a dataset the cache lacks is one error,
    before any model is loaded, that says how to get it."""
    import datasets
    import huggingface_hub

    for name in OFFLINE_VARIABLES:
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    (tmp_path / "hub_only.yaml").write_text(HUB_TASK)
    args = ["eval", str(tiny["ckpt"]), "--tasks", "hub_only", "--include-path", str(tmp_path)]
    started = time.monotonic()
    assert main(args) == 2
    assert time.monotonic() - started < 20
    err = capsys.readouterr().err
    assert "Hub (http://127.0.0.1:9) cannot be reached" in err
    assert "cannot load the datasets of hub_only" in err
    assert "TaskManager().load(['hub_only'])" in err and "HF_DATASETS_OFFLINE=1" in err


def test_data_of_another_vocabulary_is_one_error(tiny, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(LONG * 4)
    bigger = tmp_path / "bigger"
    prepare = ["prepare", "--input", str(text), "--train-tokenizer", "400", "--num-workers", "0"]
    assert main([*prepare, "--output", str(bigger)]) == 0
    assert main(["eval", str(tiny["ckpt"]), "--data", str(bigger), "--seq-len", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    vocab = json.loads((bigger / "index.json").read_text())["vocab_size"]
    assert vocab > 320
    assert f"vocabulary of {bigger} ({vocab} tokens) does not match the checkpoint's model" in err
    assert "vocabulary has 320 tokens" in err


def test_eval_tasks_config_problems():
    base = [f"--eval.tasks={json.dumps(TASKS)}", "--distributed.pp=2", "--model.n_layers=2"]
    with pytest.raises(ConfigError) as error:
        load_config(DEBUG_CONFIG, base, world_size=2)
    assert "split by pp = 2" in str(error.value) and "kiln eval CKPT --tasks" in str(error.value)
    assert "neither eval.tasks_interval nor eval.interval" in str(error.value)
    with pytest.raises(ConfigError, match=r"eval\.tasks is empty"):
        load_config(DEBUG_CONFIG, ["--eval.tasks_interval=5"], world_size=1)


def test_eval_tasks_during_training_are_logged(tiny, demo_data, tmp_path):
    run = tmp_path / "run"
    args = ["train", str(DEBUG_CONFIG), f"--data.path={demo_data}", f"--metrics.run_dir={run}"]
    args += ["--data.num_workers=0", "--train.max_steps=2", "--scheduler.warmup_steps=1"]
    args += ["--train.seq_len=32"]
    args += ["--train.batch_size=2", "--checkpoint.interval=0", "--checkpoint.save_final=false"]
    args += [f"--eval.tasks={json.dumps(TASKS)}", "--eval.tasks_interval=2"]
    args += [f"--eval.tasks_path={tiny['tasks']}", "--eval.tasks_limit=2"]
    assert main(args) == 0
    (last,) = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] == 2]
    assert 0 <= last["eval/tiny_choice/acc"] <= 1
    assert last["eval/tiny_perplexity/bits_per_byte"] > 0
    assert last["eval/tiny_generation/exact_match"] == 0  # random weights
    assert "eval/loss" not in last  # eval.interval = 0: the held-out loss is not due
