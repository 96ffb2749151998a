"""Open the training data a [data] section names, building the built-in corpus on first use."""

from __future__ import annotations

from pathlib import Path

from kiln.config.sections import DataConfig
from kiln.data.dataset import TokenDataset
from kiln.data.demo_corpus import ensure_demo_corpus
from kiln.data.tokenizer import tokenizer_hash
from kiln.errors import ConfigError


def open_training_data(cfg: DataConfig, *, seq_len: int, model_vocab_size: int) -> TokenDataset:
    if cfg.tokenizer and not Path(cfg.tokenizer).is_file():
        raise ConfigError(
            f"data.tokenizer: {cfg.tokenizer} not found; point it at a tokenizer.json or leave it empty"
        )
    path = Path(cfg.path)
    if cfg.source == "demo":
        ensure_demo_corpus(path)
    dataset = TokenDataset(path, seq_len)
    if dataset.vocab_size > model_vocab_size:
        raise ConfigError(
            f"model.vocab_size ({model_vocab_size}) is smaller than the vocabulary of the data's tokenizer "
            f"({dataset.vocab_size}): set model.vocab_size >= {dataset.vocab_size}"
        )
    if cfg.tokenizer and tokenizer_hash(cfg.tokenizer) != tokenizer_hash(dataset.tokenizer_path):
        raise ConfigError(
            f"data.tokenizer {cfg.tokenizer} is not the tokenizer {path} was prepared with; "
            "re-run `kiln prepare` with it or leave data.tokenizer empty"
        )
    return dataset
