"""`kiln prepare`: text / JSONL / Parquet files and Hugging Face datasets -> a tokenized,
sharded dataset directory, optionally with a validation split in `<output>/val`."""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.inputs import Input, describe_sources, resolve_inputs
from kiln.data.shards import (
    DEFAULT_SHARD_TOKENS,
    INDEX_FILE,
    DatasetExistsError,
    ShardWriter,
    check_output_free,
    check_shard,
    read_index,
)
from kiln.data.tokenize import Progress, tokenize_batches
from kiln.data.tokenizer import load_tokenizer, tokenizer_hash, train_bpe_tokenizer
from kiln.data.units import WorkUnit, keyed_batches, whole_sources
from kiln.errors import KilnError

VAL_DIR = "val"
HASH_CHUNK = 2**22


@dataclass(frozen=True)
class ValSplit:
    """A document is held out iff the hash of its key (source number, position in the source;
    see units.document_keys) is below threshold: whole documents, chosen by where they are in
    the inputs alone, so the split is the same whatever the number of workers or parts."""

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
    part: int = 0,
    parts: int = 1,
) -> Path:
    """Tokenize every document of `inputs` into a dataset at `output`; returns its path.

    Inputs are files, folders (searched recursively), glob patterns, folders written by
    `datasets` `save_to_disk`, or `hf:NAME[:CONFIG]` datasets in the local Hugging Face cache.
    `.txt` files are one document each; `.jsonl` lines, `.parquet` rows and dataset rows are one
    document each (field / column `text_key`; `split` picks the split of a dataset). Pass a
    `tokenizer.json` or `train_tokenizer=VOCAB_SIZE` to train a byte-level BPE on the inputs.
    `val_fraction` or `val_documents` holds whole documents out into `<output>/val`.
    `num_workers` tokenizer processes (default: one per CPU; 0 tokenizes in this process).

    Inputs may be URLs (http(s)://, s3://, gs://: a file, or a prefix or glob in a store).
    `parts` > 1 makes this process part `part` of a run split over `parts` processes (see
    prepare_parts): the dataset is the same as one process makes.

    Output is written atomically. If `output` already holds a dataset made from the same
    inputs, tokenizer and options this is a no-op; if it holds another one, an error (unless
    `overwrite`).
    """
    output = Path(output)
    check_options(tokenizer_path, train_tokenizer, val_fraction, val_documents, shard_tokens)
    options = {
        "text_key": text_key,
        "split": split,
        "shard_tokens": shard_tokens,
        "train_tokenizer": train_tokenizer,
        "val_fraction": val_fraction,
        "val_documents": val_documents,
    }
    if parts != 1 or part != 0:
        from kiln.data.prepare_parts import prepare_part

        return prepare_part(
            inputs, tokenizer_path, output, options, part, parts, num_workers, overwrite
        )
    if tokenizer_path is not None:
        load_tokenizer(tokenizer_path)  # a bad tokenizer fails now, not after reading the inputs
    resolved, metadata = resolve_and_describe(inputs, options)
    if not overwrite and is_prepared(output, metadata, tokenizer_path):
        print(
            f"prepare: {output} is already prepared from these inputs and options", file=sys.stderr
        )
        return output
    check_output_free(output, overwrite)
    units = whole_sources(resolved, source_sizes(metadata))
    val = choose_val_split(units, text_key, split, val_fraction, val_documents)
    with tempfile.TemporaryDirectory() as tmp:
        if train_tokenizer is not None:
            tokenizer_path = Path(tmp) / "tokenizer.json"
            texts = training_texts(units, text_key, split, val)
            print(f"prepare: training a {train_tokenizer}-token BPE tokenizer", file=sys.stderr)
            tokenizer = train_bpe_tokenizer(texts, train_tokenizer)
            note_small_vocabulary(tokenizer.get_vocab_size(), train_tokenizer)
            tokenizer.save(str(tokenizer_path))
        workers = (os.cpu_count() or 1) if num_workers is None else num_workers
        return write_dataset(
            resolved,
            units,
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


def resolve_and_describe(
    inputs: list[str | Path], options: dict[str, Any]
) -> tuple[list[Input], dict[str, Any]]:
    """The inputs expanded into sources, and the index metadata that says what they are."""
    resolved = resolve_inputs(inputs)
    sources = describe_sources(resolved, options["split"])
    return resolved, {"sources": sources, "prepare": options}


def source_sizes(metadata: dict[str, Any]) -> list[int]:
    """Bytes of every file source (0 for a dataset, whose units are weighed by its rows)."""
    # An HTTP server that sends no Content-Length leaves a file's size unknown (None): it then
    # weighs as little as an empty one when parts are balanced, rather than failing.
    return [source.get("bytes") or 0 for source in metadata["sources"]]


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
    units: list[WorkUnit],
    text_key: str,
    split: str,
    val_fraction: float | None,
    val_documents: int | None,
) -> ValSplit | None:
    if val_fraction is not None:
        return ValSplit(int(val_fraction * 2**64))
    if val_documents is None:
        return None
    print("prepare: reading every document to pick the validation split", file=sys.stderr)
    counts = [0] * (max((unit.input_index for unit in units), default=0) + 1)
    keys = (keys for keys, _ in keyed_batches(units, text_key, split, counts))
    bound = smallest_hashes_bound(val_documents, keys)
    if val_documents >= sum(counts):
        raise KilnError(
            f"--val-documents {val_documents} leaves nothing to train on: the inputs hold "
            f"{sum(counts)} documents; ask for fewer"
        )
    return ValSplit(bound)


def smallest_hashes_bound(count: int, batches: Iterator[np.ndarray]) -> int:
    """A threshold that exactly `count` of the document keys in `batches` are below (64-bit
    hashes of distinct keys: equal ones are too rare to matter)."""
    smallest = np.empty(0, dtype=np.uint64)
    # Keeping only the `count` smallest, so memory does not grow with the corpus.
    for keys in batches:
        smallest = np.concatenate([smallest, keys])
        if len(smallest) > max(HASH_CHUNK, 2 * count):
            smallest = np.partition(smallest, count - 1)[:count]
    if len(smallest) > count:
        smallest = np.partition(smallest, count - 1)[:count]
    return int(smallest.max()) + 1 if len(smallest) else 0


def training_texts(
    units: list[WorkUnit], text_key: str, split: str, val: ValSplit | None
) -> Iterator[str]:
    """The documents that are not held out, streamed: a tokenizer is trained on these only."""
    counts = [0] * (max((unit.input_index for unit in units), default=0) + 1)
    for keys, batch in keyed_batches(units, text_key, split, counts):
        held_out = val_mask(val, keys)
        yield from (text for text, out in zip(batch, held_out, strict=True) if not out)


def val_mask(val: ValSplit | None, keys: np.ndarray) -> np.ndarray:
    """Which of the documents with these keys are held out for validation."""
    if val is None:
        return np.zeros(len(keys), dtype=bool)
    return keys < np.uint64(min(val.threshold, 2**64 - 1))


def write_dataset(
    inputs: list[Input],
    units: list[WorkUnit],
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
    with ShardWriter(
        output, tokenizer_path, shard_tokens=shard_tokens, overwrite=overwrite, metadata=metadata
    ) as writer:
        write_units(units, len(inputs), writer, val, text_key, split, workers, inputs=inputs)
    return writer.path


def write_units(
    units: list[WorkUnit],
    num_inputs: int,
    writer: ShardWriter,
    val: ValSplit | None,
    text_key: str,
    split: str,
    workers: int,
    *,
    val_writer_type: type[ShardWriter] = ShardWriter,
    inputs: list[Input] | None = None,
) -> list[int]:
    """Tokenize the documents of `units` into `writer` and, held out, a validation split in its
    staging folder; returns the number of documents of each input. Given all the `inputs`
    (a whole dataset, not a part), check that neither they nor the splits are empty."""
    counts = [0] * num_inputs
    keys_in_flight: collections.deque[np.ndarray] = collections.deque()

    def texts() -> Iterator[list[str]]:
        # The tokenizer gets the texts; their keys wait here, in the same order.
        for keys, batch in keyed_batches(units, text_key, split, counts):
            keys_in_flight.append(keys)
            yield batch

    # Inside the staging folder, so the split is published with the dataset, in one rename.
    val_writer = (
        val_writer_type(
            writer.staging_dir / VAL_DIR, writer.tokenizer_path, shard_tokens=writer.shard_tokens
        )
        if val
        else contextlib.nullcontext()
    )
    with val_writer as held_out:
        tokenized = tokenize_batches(texts(), writer.tokenizer_path, writer.dtype, workers)
        route_documents(tokenized, keys_in_flight, writer, held_out, val)
        if inputs is not None:  # before the splits are closed, which refuses an empty one
            check_inputs_have_documents([item.argument for item in inputs], counts)
            check_split_sizes(writer.num_documents, held_out and held_out.num_documents)
    if held_out is not None:
        writer.metadata.update(val=VAL_DIR, num_val_documents=held_out.num_documents)
    return counts


def route_documents(
    tokenized: Iterator[tuple[list[np.ndarray], int]],
    keys_in_flight: collections.deque[np.ndarray],
    writer: ShardWriter,
    held_out: ShardWriter | None,
    val: ValSplit | None,
) -> None:
    """Write each document to the training or the validation split."""
    progress = Progress()
    total = tokens = 0
    for documents, num_bytes in tokenized:
        to_val = val_mask(val, keys_in_flight.popleft())
        for document, goes_to_val in zip(documents, to_val, strict=True):
            (held_out if goes_to_val else writer).add_document(document)
            tokens += len(document) + 1
        total += len(documents)
        progress.update(total, tokens, num_bytes)
    progress.finish(total, tokens)


def check_inputs_have_documents(arguments: list[str], counts: list[int]) -> None:
    """An input without a single document is an error: most likely a wrong file or pattern."""
    for argument, count in zip(arguments, counts, strict=True):
        if count == 0:
            raise KilnError(
                f"input {argument} holds no documents (its files or texts are empty); "
                "remove it from the inputs"
            )


def check_split_sizes(train: int, val: int | None) -> None:
    """Neither split may be empty."""
    if val == 0:
        raise KilnError(
            f"the validation split is empty: --val-fraction picked none of the {train} "
            "documents; use a larger fraction or --val-documents"
        )
    if train == 0:
        raise KilnError(
            f"all {val} documents went to the validation split; use a smaller --val-fraction"
        )
