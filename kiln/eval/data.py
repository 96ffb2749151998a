"""The data `kiln eval CKPT --data` scores: a prepared dataset, or text files (anything `kiln
prepare` reads) tokenized with the checkpoint's tokenizer; either checked against the
checkpoint's vocabulary before the model is built."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from kiln.data.dataset import TokenDataset
from kiln.data.prepare import prepare_dataset
from kiln.data.remote_shards import remote_dataset_exists
from kiln.data.shards import INDEX_FILE
from kiln.data.tokenizer import load_tokenizer, tokenizer_hash
from kiln.errors import ConfigError
from kiln.remote import is_url


def open_checkpoint_data(
    inputs: list[str],
    *,
    seq_len: int,
    model_vocab_size: int,
    tokenizer: Path | None,
    scratch: Path,
    quiet: bool = False,
) -> TokenDataset:
    """`inputs`: one prepared dataset (a folder or a URL, read as training reads it), or text,
    JSONL or Parquet files, folders or globs, tokenized into `scratch` with `tokenizer` (the
    checkpoint's). `quiet`: no progress on stderr (every rank but the first tokenizes too)."""
    if len(inputs) == 1 and _is_prepared(inputs[0]):
        dataset = TokenDataset(inputs[0], seq_len)
        _check_vocab(dataset.vocab_size, model_vocab_size, where=dataset.path, tokenizer=tokenizer)
        if tokenizer is not None and tokenizer_hash(dataset.tokenizer_path) != tokenizer_hash(
            tokenizer
        ):
            raise ConfigError(
                f"{dataset.path} was tokenized with another tokenizer than the checkpoint's "
                f"({tokenizer}), so its loss would not measure this model: prepare the text with "
                f"`kiln prepare ... --tokenizer {tokenizer}`, or pass the text files to --data"
            )
        return dataset
    if tokenizer is None:
        raise ConfigError(
            "--data names text files, which kiln eval tokenizes with the checkpoint's "
            "tokenizer.json, but the checkpoint has none: copy the tokenizer the model was "
            "trained with beside it, or pass a dataset prepared with it"
        )
    vocab_size = load_tokenizer(tokenizer).get_vocab_size()
    _check_vocab(vocab_size, model_vocab_size, where=tokenizer, tokenizer=tokenizer)
    output = scratch / "data"
    with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
        prepare_dataset(inputs, tokenizer, output, num_workers=0)
    return TokenDataset(output, seq_len)


def _is_prepared(location: str) -> bool:
    """Whether `location` is a dataset `kiln prepare` wrote, rather than text to tokenize."""
    if is_url(location):
        return remote_dataset_exists(location)
    return (Path(location) / INDEX_FILE).is_file()


def _check_vocab(
    vocab_size: int, model_vocab_size: int, *, where: Path, tokenizer: Path | None
) -> None:
    if vocab_size > model_vocab_size:
        fix = f"the checkpoint's tokenizer ({tokenizer})" if tokenizer else "the model's tokenizer"
        raise ConfigError(
            f"the vocabulary of {where} ({vocab_size} tokens) does not match the checkpoint's "
            f"model, whose vocabulary has {model_vocab_size} tokens (model.vocab_size): the data "
            f"was tokenized for another model; evaluate text tokenized with {fix}"
        )
