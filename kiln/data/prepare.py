"""`kiln prepare`: text / JSONL / Parquet files and Hugging Face datasets -> a tokenized,
sharded dataset directory, optionally with a validation split in `<output>/val`."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.inputs import Input, describe_sources, iter_texts, resolve_inputs
from kiln.data.shards import (
    DEFAULT_SHARD_TOKENS,
    INDEX_FILE,
    DatasetExistsError,
    ShardWriter,
    check_output_free,
    check_shard,
    read_index,
)
from kiln.data.tokenize import Progress, batched_texts, tokenize_batches
from kiln.data.tokenizer import load_tokenizer, tokenizer_hash, train_bpe_tokenizer
from kiln.errors import KilnError

VAL_DIR = "val"
HASH_CHUNK = 2**22


@dataclass(frozen=True)
class ValSplit:
    """Document number i (counting from 0 over all inputs) is held out iff hash(i) < threshold:
    whole documents, chosen by their number alone, so the split is the same whatever the number
    of workers or the batching."""

    threshold: int


def prepare_dataset(
    inputs: list[str | Path],
    tokenizer_path: str | Path | None,
    output: str | Path,
    *,
    text_key: str = "text",
    split: str = "train",
    train_tokenizer: int | None = None,
    val_fraction: float | None = None,
    val_documents: int | None = None,
    num_workers: int | None = None,
    overwrite: bool = False,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
) -> Path:
    """Tokenize every document of `inputs` into a dataset at `output`; returns its path.

    Inputs are files, folders (searched recursively), glob patterns, folders written by
    `datasets` `save_to_disk`, or `hf:NAME[:CONFIG]` datasets in the local Hugging Face cache.
    `.txt` files are one document each; `.jsonl` lines, `.parquet` rows and dataset rows are one
    document each (field / column `text_key`; `split` picks the split of a dataset). Pass a
    `tokenizer.json` or `train_tokenizer=VOCAB_SIZE` to train a byte-level BPE on the inputs.
    `val_fraction` or `val_documents` holds whole documents out into `<output>/val`.
    `num_workers` tokenizer processes (default: one per CPU; 0 tokenizes in this process).

    Output is written atomically. If `output` already holds a dataset made from the same
    inputs, tokenizer and options this is a no-op; if it holds another one, an error (unless
    `overwrite`).
    """
    output = Path(output)
    check_options(tokenizer_path, train_tokenizer, val_fraction, val_documents, shard_tokens)
    if tokenizer_path is not None:
        load_tokenizer(tokenizer_path)  # a bad tokenizer fails now, not after reading the inputs
    resolved = resolve_inputs(inputs)
    options = {
        "text_key": text_key,
        "split": split,
        "shard_tokens": shard_tokens,
        "train_tokenizer": train_tokenizer,
        "val_fraction": val_fraction,
        "val_documents": val_documents,
    }
    metadata = {"sources": describe_sources(resolved, split), "prepare": options}
    if not overwrite and is_prepared(output, metadata, tokenizer_path):
        print(
            f"prepare: {output} is already prepared from these inputs and options", file=sys.stderr
        )
        return output
    check_output_free(output, overwrite)
    val = choose_val_split(resolved, text_key, split, val_fraction, val_documents)
    with tempfile.TemporaryDirectory() as tmp:
        if train_tokenizer is not None:
            tokenizer_path = Path(tmp) / "tokenizer.json"
            texts = training_texts(resolved, text_key, split, val)
            print(f"prepare: training a {train_tokenizer}-token BPE tokenizer", file=sys.stderr)
            tokenizer = train_bpe_tokenizer(texts, train_tokenizer)
            note_small_vocabulary(tokenizer.get_vocab_size(), train_tokenizer)
            tokenizer.save(str(tokenizer_path))
        workers = (os.cpu_count() or 1) if num_workers is None else num_workers
        return write_dataset(
            resolved,
            tokenizer_path,
            output,
            text_key=text_key,
            split=split,
            val=val,
            workers=workers,
            overwrite=overwrite,
            shard_tokens=shard_tokens,
            metadata=metadata,
        )


def note_small_vocabulary(learned: int, asked: int) -> None:
    """BPE stops when the text has no pair left to merge: on a small corpus the vocabulary is
    smaller than asked, which the user should know before sizing model.vocab_size."""
    if learned < asked:
        print(
            f"prepare: the inputs are too small for a {asked}-token vocabulary: BPE learned "
            f"every merge they hold and stopped at {learned} tokens. The tokenizer has "
            f"{learned} tokens (model.vocab_size >= {learned} fits it); more text gives a "
            "larger one",
            file=sys.stderr,
        )


def check_options(
    tokenizer_path: str | Path | None,
    train_tokenizer: int | None,
    val_fraction: float | None,
    val_documents: int | None,
    shard_tokens: int,
) -> None:
    """Reject contradictory or out-of-range options before any input is read."""
    if (tokenizer_path is None) == (train_tokenizer is None):
        raise KilnError(
            "pass either a tokenizer.json (--tokenizer) or a vocabulary size to train one on "
            "the inputs (--train-tokenizer), not both or neither"
        )
    if val_fraction is not None and val_documents is not None:
        raise KilnError("pass either --val-fraction or --val-documents, not both")
    if val_fraction is not None and not 0 < val_fraction < 1:
        raise KilnError(f"--val-fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if val_documents is not None and val_documents < 1:
        raise KilnError(f"--val-documents must be at least 1, got {val_documents}")
    if shard_tokens <= 0:
        raise KilnError(f"--shard-tokens must be positive, got {shard_tokens}")


def is_prepared(output: Path, metadata: dict[str, Any], tokenizer_path: str | Path | None) -> bool:
    """True if `output` holds this very dataset, complete; an error if it holds another one."""
    if not (output / INDEX_FILE).is_file():
        return False
    index = read_index(output)
    differs = [
        name
        for name, key in (("inputs", "sources"), ("options", "prepare"))
        if index.get(key) != metadata[key]
    ]
    if tokenizer_path is not None and index["tokenizer_sha256"] != tokenizer_hash(tokenizer_path):
        differs.append("tokenizer")
    if differs:
        raise DatasetExistsError(
            f"{output} holds a different dataset (other {', '.join(differs)}); pass "
            "overwrite=True (--overwrite) to replace it or choose another output"
        )
    check_complete(output, index)
    return True


def check_complete(path: Path, index: dict[str, Any]) -> None:
    """Raise if a file of the dataset at `path` (or of its validation split) is damaged."""
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    for shard in index["shards"]:
        check_shard(path, shard, dtype, index["vocab_size"])
    if "val" in index:
        check_complete(path / index["val"], read_index(path / index["val"]))


def choose_val_split(
    inputs: list[Input],
    text_key: str,
    split: str,
    val_fraction: float | None,
    val_documents: int | None,
) -> ValSplit | None:
    if val_fraction is not None:
        return ValSplit(int(val_fraction * 2**64))
    if val_documents is None:
        return None
    print("prepare: counting documents to pick the validation split", file=sys.stderr)
    total = sum(1 for _ in iter_texts(inputs, text_key, split))
    if val_documents >= total:
        raise KilnError(
            f"--val-documents {val_documents} leaves nothing to train on: the inputs hold "
            f"{total} documents; ask for fewer"
        )
    return ValSplit(smallest_hashes_bound(val_documents, total))


def smallest_hashes_bound(count: int, total: int) -> int:
    """A threshold that exactly `count` of the hashes of 0 .. total - 1 are below."""
    smallest = np.empty(0, dtype=np.uint64)
    # In chunks, keeping only the `count` smallest, so memory does not grow with the corpus.
    for start in range(0, total, HASH_CHUNK):
        hashes = ordinal_hashes(np.arange(start, min(start + HASH_CHUNK, total), dtype=np.uint64))
        smallest = np.concatenate([smallest, hashes])
        if len(smallest) > count:
            smallest = np.partition(smallest, count - 1)[:count]
    # The hash is a bijection, so no other number shares the largest kept value.
    return int(smallest.max()) + 1


def ordinal_hashes(ordinals: np.ndarray) -> np.ndarray:
    """splitmix64 of uint64 numbers: consecutive numbers get unrelated, uniform hashes."""
    z = ordinals + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def training_texts(
    inputs: list[Input], text_key: str, split: str, val: ValSplit | None
) -> Iterator[str]:
    """The documents that are not held out, streamed: a tokenizer is trained on these only."""
    start = 0
    for batch in batched_texts(iter_texts(inputs, text_key, split)):
        held_out = val_mask(val, start, len(batch))
        yield from (text for text, out in zip(batch, held_out, strict=True) if not out)
        start += len(batch)


def val_mask(val: ValSplit | None, start: int, count: int) -> np.ndarray:
    """Which of documents start .. start + count - 1 are held out for validation."""
    if val is None:
        return np.zeros(count, dtype=bool)
    return ordinal_hashes(np.arange(start, start + count, dtype=np.uint64)) < val.threshold


def write_dataset(
    inputs: list[Input],
    tokenizer_path: str | Path,
    output: Path,
    *,
    text_key: str,
    split: str,
    val: ValSplit | None,
    workers: int,
    overwrite: bool,
    shard_tokens: int,
    metadata: dict[str, Any],
) -> Path:
    batches = batched_texts(iter_texts(inputs, text_key, split))
    with ShardWriter(
        output, tokenizer_path, shard_tokens=shard_tokens, overwrite=overwrite, metadata=metadata
    ) as writer:
        # Inside the staging folder, so the split is published with the dataset, in one rename.
        val_writer = (
            ShardWriter(writer.staging_dir / VAL_DIR, tokenizer_path, shard_tokens=shard_tokens)
            if val
            else contextlib.nullcontext()
        )
        with val_writer as held_out:
            tokenized = tokenize_batches(batches, tokenizer_path, writer.dtype, workers)
            total = route_documents(tokenized, writer, held_out, val)
            check_split_sizes(writer, held_out, total)
        if held_out is not None:
            writer.metadata.update(val=VAL_DIR, num_val_documents=held_out.num_documents)
    return writer.path


def route_documents(
    tokenized: Iterator[tuple[list[np.ndarray], int]],
    writer: ShardWriter,
    held_out: ShardWriter | None,
    val: ValSplit | None,
) -> int:
    """Write each document to the training or the validation split; returns their number."""
    progress = Progress()
    total = tokens = 0
    for documents, num_bytes in tokenized:
        to_val = val_mask(val, total, len(documents))
        for document, goes_to_val in zip(documents, to_val, strict=True):
            (held_out if goes_to_val else writer).add_document(document)
            tokens += len(document) + 1
        total += len(documents)
        progress.update(total, tokens, num_bytes)
    progress.finish(total, tokens)
    return total


def check_split_sizes(writer: ShardWriter, held_out: ShardWriter | None, total: int) -> None:
    if held_out is not None and held_out.num_documents == 0:
        raise KilnError(
            f"the validation split is empty: --val-fraction picked none of the {total} "
            "documents; use a larger fraction or --val-documents"
        )
    if writer.num_documents == 0:
        raise KilnError(
            f"all {total} documents went to the validation split; use a smaller --val-fraction"
        )
