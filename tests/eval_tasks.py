"""A tiny kiln checkpoint and tiny local lm-evaluation-harness tasks, written by the eval tests
(no downloads): one task of each kind of request (multiple choice: loglikelihood; perplexity:
loglikelihood_rolling; generation: generate_until), with texts longer than the model's context so
that left truncation and rolling windows are exercised."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.checkpoint import save_checkpoint
from kiln.config import JobConfig, ModelConfig, TrainConfig
from kiln.data.tokenizer import train_bpe_tokenizer
from kiln.model import build_model, materialize

TASKS = ["tiny_choice", "tiny_perplexity", "tiny_generation"]
CONTEXT = 48  # the model's max_seq_len and train.seq_len: the harness's context
TEXTS = [
    "the quick brown fox jumps over the lazy dog.",
    "a kiln fires clay into pottery at a high heat.",
    "roses are red and the sky is blue.",
    "water boils at one hundred degrees.",
]
LONG = " ".join(TEXTS) * 2  # several windows of CONTEXT tokens


def write_checkpoint(root: Path) -> Path:
    """A two-layer model with weights drawn wide (init_std 0.3), so that its predictions are
    far from uniform and a greedy choice is never a near tie; checkpoint at root/ckpt."""
    tokenizer = root / "tokenizer.json"
    train_bpe_tokenizer(TEXTS * 4, 300).save(str(tokenizer))
    model_cfg = ModelConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=320,
        ffn_hidden_dim=128,
        max_seq_len=CONTEXT,
        init_std=0.3,
    )
    cfg = JobConfig(
        model=model_cfg,
        train=TrainConfig(seq_len=CONTEXT, batch_size=2, mixed_precision="fp32", device="cpu"),
    )
    torch.manual_seed(0)
    model = materialize(build_model(model_cfg), device="cpu", seed=0)
    save_checkpoint(
        root / "ckpt",
        1,
        model=model,
        optimizer=None,
        config=cfg,
        train_state={"step": 1},
        tokenizer_path=tokenizer,
    )
    return root / "ckpt"


def write_tasks(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    questions = [
        {"question": "what fires clay?", "choices": [" a kiln", " a fox", " the dog"], "answer": 0},
        {"question": "what is red?", "choices": [" roses", " the sky"], "answer": 0},
        {
            "question": LONG + " who jumps?",
            "choices": [" the quick brown fox", " water"],
            "answer": 0,
        },
    ]
    _jsonl(folder / "questions.jsonl", questions)
    _jsonl(folder / "texts.jsonl", [{"text": TEXTS[0]}, {"text": LONG}])
    common = (
        f"dataset_path: json\ntest_split: test\ndataset_kwargs:\n  cache_dir: {folder / 'cache'}\n"
    )
    (folder / "tiny_choice.yaml").write_text(
        f"task: tiny_choice\n{common}"
        f"  data_files:\n    test: {folder / 'questions.jsonl'}\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Q: {{question}}\\nA:"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (folder / "tiny_perplexity.yaml").write_text(
        f"task: tiny_perplexity\n{common}"
        f"  data_files:\n    test: {folder / 'texts.jsonl'}\n"
        "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\n'
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n"
    )
    # Stops at "e": random weights produce some early, so the stop sequences are exercised.
    (folder / "tiny_generation.yaml").write_text(
        f"task: tiny_generation\n{common}"
        f"  data_files:\n    test: {folder / 'questions.jsonl'}\n"
        "output_type: generate_until\n"
        'doc_to_text: "Q: {{question}}\\nA:"\n'
        'doc_to_target: "{{choices[answer]}}"\n'
        'generation_kwargs:\n  until: ["\\n", "e"]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
