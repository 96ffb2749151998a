"""`kiln prepare`: text / JSONL / Parquet files and Hugging Face datasets -> a tokenized,
sharded dataset directory, optionally with a validation split in `<output>/val`."""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from kiln.data.shards import (
    DEFAULT_SHARD_TOKENS,
    INDEX_FILE,
    DatasetExistsError,
    ShardWriter,
    check_output_free,
    check_shard,
    read_index,
)
from kiln.data.tokenizer import encode_ids, load_tokenizer, tokenizer_hash, train_bpe_tokenizer
from kiln.errors import KilnError

SUFFIXES = (".txt", ".jsonl", ".parquet")
HF_PREFIX = "hf:"
GLOB_CHARS = "*?["
VAL_DIR = "val"
BATCH_DOCUMENTS = 1024
BATCH_BYTES = 4 * 2**20
HF_BATCH_ROWS = 1024
HASH_CHUNK = 2**22


@dataclass(frozen=True)
class InputSource:
    """One thing documents are read from: a file, or a Hugging Face dataset (a folder written
    by `save_to_disk`, or `hf:NAME[:CONFIG]` in the local cache)."""

    kind: str  # "txt", "jsonl", "parquet" or "hf"
    location: str


@dataclass(frozen=True)
class Input:
    """One input as the user named it (file, folder, glob, dataset) and what it expands to."""

    argument: str
    sources: tuple[InputSource, ...]


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
            train_bpe_tokenizer(texts, train_tokenizer).save(str(tokenizer_path))
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


# --- inputs ------------------------------------------------------------------------------


def resolve_inputs(inputs: Iterable[str | Path]) -> list[Input]:
    """Expand each input into the files / datasets it names, in sorted order."""
    resolved = [Input(str(item), tuple(expand_input(str(item)))) for item in inputs]
    if not resolved:
        raise KilnError("no inputs given; pass files, folders, glob patterns or datasets")
    named_by: dict[str, str] = {}
    for item in resolved:
        for source in item.sources:
            identity = source_identity(source)
            if identity in named_by:
                raise KilnError(
                    f"input {source.location} is named twice (by {named_by[identity]} and "
                    f"{item.argument}); name every file once, or its documents would be in the "
                    "dataset twice"
                )
            named_by[identity] = item.argument
    return resolved


def source_identity(source: InputSource) -> str:
    """The same for two names of one file or dataset."""
    if source.location.startswith(HF_PREFIX):
        return source.location
    return str(Path(source.location).resolve())


def expand_input(item: str) -> list[InputSource]:
    if item.startswith(HF_PREFIX):
        return [InputSource("hf", item)]
    if not any(char in item for char in GLOB_CHARS):
        return path_sources(Path(item))
    matches = sorted(glob.glob(item, recursive=True))
    if not matches:
        raise KilnError(
            f"input pattern {item!r} matches nothing; check it (and quote it, so that the "
            "shell passes it to kiln unexpanded)"
        )
    # A pattern selects files and saved datasets; folders it happens to match are skipped.
    sources = [
        source
        for match in map(Path, matches)
        if is_saved_dataset(match) or (match.is_file() and match.suffix in SUFFIXES)
        for source in path_sources(match)
    ]
    if not sources:
        raise KilnError(
            f"input pattern {item!r} matches no {', '.join(SUFFIXES)} files or saved datasets"
        )
    return sources


def path_sources(path: Path) -> list[InputSource]:
    if is_saved_dataset(path):
        return [InputSource("hf", str(path))]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        if not files:
            raise KilnError(f"no input files ({', '.join(SUFFIXES)}) found in {path}")
        return [InputSource(file.suffix[1:], str(file)) for file in files]
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise KilnError(f"unsupported input file {path}: use {', '.join(SUFFIXES)} files")
        return [InputSource(path.suffix[1:], str(path))]
    raise KilnError(
        f"input not found: {path}; pass existing files, folders, glob patterns or datasets"
    )


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def describe_sources(inputs: list[Input], split: str) -> list[dict[str, Any]]:
    """What the dataset is made of, precisely enough to tell when an input has changed."""
    described = []
    for source in (source for item in inputs for source in item.sources):
        if source.kind == "hf":
            dataset = open_hf_dataset(source.location, split)
            # The fingerprint of a saved or cached dataset changes whenever its content does.
            described.append(
                {
                    "dataset": source_identity(source),
                    "split": split,
                    "fingerprint": dataset._fingerprint,
                }
            )
        else:
            stat = Path(source.location).stat()
            described.append(
                {
                    "path": source_identity(source),
                    "bytes": stat.st_size,
                    "mtime_ns": stat.st_mtime_ns,
                }
            )
    return described


def iter_texts(inputs: list[Input], text_key: str, split: str) -> Iterator[str]:
    """Every non-empty document of every input, in order; an input without any is an error."""
    for item in inputs:
        found = False
        for source in item.sources:
            for text in read_source(source, text_key, split):
                found = True
                yield text
        if not found:
            raise KilnError(
                f"input {item.argument} holds no documents (its files or texts are empty); "
                "remove it from the inputs"
            )


def read_source(source: InputSource, text_key: str, split: str) -> Iterator[str]:
    readers = {"txt": read_txt, "jsonl": read_jsonl, "parquet": read_parquet, "hf": read_hf}
    try:
        for text in readers[source.kind](source.location, text_key, split):
            if text:
                yield text
    except (OSError, UnicodeDecodeError) as e:
        raise KilnError(f"cannot read input {source.location}: {e}") from None


def read_txt(location: str, text_key: str, split: str) -> Iterator[str]:
    yield Path(location).read_text(encoding="utf-8")


def read_jsonl(location: str, text_key: str, split: str) -> Iterator[str]:
    with open(location, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{location}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise KilnError(f"{where}: invalid JSON ({e})") from None
            if not isinstance(record, dict):
                raise KilnError(f"{where}: expected a JSON object with a {text_key!r} field")
            if text_key not in record:
                raise KilnError(
                    f"{where}: no field {text_key!r} (fields: {', '.join(record)}); "
                    "set text_key (--text-key) to the field that holds the text"
                )
            text = record[text_key]
            if text is not None and not isinstance(text, str):
                raise KilnError(
                    f"{where}: field {text_key!r} is a {type(text).__name__}, not a string; "
                    "set text_key (--text-key) to the field that holds the text"
                )
            yield text or ""


def read_parquet(location: str, text_key: str, split: str) -> Iterator[str]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise KilnError(
            f"reading {location} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    try:
        parquet = pq.ParquetFile(location)
    except Exception as e:
        raise KilnError(f"cannot read parquet file {location}: {e}") from None
    schema = parquet.schema_arrow
    if text_key not in schema.names:
        raise KilnError(
            f"{location} has no column {text_key!r} (columns: {', '.join(schema.names)}); "
            "set text_key (--text-key) to the column that holds the text"
        )
    kind = schema.field(text_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise KilnError(
            f"{location}: column {text_key!r} holds {kind}, not text; "
            "set text_key (--text-key) to the column that holds the text"
        )
    for batch in parquet.iter_batches(columns=[text_key]):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


def read_hf(location: str, text_key: str, split: str) -> Iterator[str]:
    dataset = open_hf_dataset(location, split)
    if text_key not in dataset.column_names:
        raise KilnError(
            f"{location} has no column {text_key!r} (columns: {', '.join(dataset.column_names)}); "
            "set text_key (--text-key) to the column that holds the text"
        )
    kind = getattr(dataset.features[text_key], "dtype", None)
    if kind not in ("string", "large_string"):
        raise KilnError(
            f"{location}: column {text_key!r} holds {dataset.features[text_key]}, not text; "
            "set text_key (--text-key) to the column that holds the text"
        )
    for batch in dataset.select_columns([text_key]).iter(batch_size=HF_BATCH_ROWS):
        yield from (text for text in batch[text_key] if text is not None)


def open_hf_dataset(location: str, split: str) -> Any:
    """One split of a `save_to_disk` folder or of a dataset in the local Hugging Face cache."""
    datasets = import_datasets_offline(location)
    if location.startswith(HF_PREFIX):
        return load_cached_dataset(datasets, location, split)
    try:
        loaded = datasets.load_from_disk(location)
    except Exception as e:
        raise KilnError(f"cannot read the saved dataset {location}: {one_line(e)}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise KilnError(
                f"{location} has no split {split!r} (splits: {', '.join(loaded)}); "
                "choose one with split (--split)"
            )
        loaded = loaded[split]
    return loaded


def load_cached_dataset(datasets: ModuleType, location: str, split: str) -> Any:
    name, _, config = location[len(HF_PREFIX) :].partition(":")
    try:
        return datasets.load_dataset(name, config or None, split=split)
    except ConnectionError:
        # Offline, the library reports a dataset missing from the cache as unreachable.
        raise KilnError(
            f"{location}: {name} is not in the local Hugging Face cache "
            f"({datasets.config.HF_DATASETS_CACHE}); kiln prepare never downloads: load it once "
            "with `datasets.load_dataset` where there is network (same HF_HOME), or pass a "
            "folder written by save_to_disk"
        ) from None
    except Exception as e:
        raise KilnError(f"cannot load {location} from the local cache: {one_line(e)}") from None


def import_datasets_offline(location: str) -> ModuleType:
    """The `datasets` library, switched to offline mode: the local cache or nothing."""
    # The libraries read these switches at import: set the environment for an import still to
    # come and the module values for one that already happened.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
        import huggingface_hub.constants
    except ImportError:
        raise KilnError(
            f"reading the Hugging Face dataset {location} needs `datasets`: pip install datasets"
        ) from None
    datasets.config.HF_HUB_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    # Its "using the cached version" warnings would break up the progress line.
    datasets.logging.set_verbosity_error()
    return datasets


def one_line(error: BaseException) -> str:
    return "; ".join(line for line in str(error).splitlines() if line.strip()) or repr(error)


# --- re-runs and the validation split ----------------------------------------------------


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


# --- tokenizing and writing --------------------------------------------------------------


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


def batched_texts(texts: Iterator[str]) -> Iterator[list[str]]:
    """Group documents so each tokenizer call amortizes its overhead over many of them."""
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if len(batch) >= BATCH_DOCUMENTS or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def tokenize_batches(
    batches: Iterator[list[str]], tokenizer_path: str | Path, dtype: np.dtype, workers: int
) -> Iterator[tuple[list[np.ndarray], int]]:
    """(token arrays, utf-8 bytes of text) per batch, in input order."""
    if workers <= 0:
        tokenizer = load_tokenizer(tokenizer_path)
        for batch in batches:
            yield encode_texts(tokenizer, dtype, batch)
        return
    # spawn, not fork: forking after the tokenizers thread pool has started can deadlock.
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, _worker_init, (str(tokenizer_path), dtype)) as pool:
        # A bounded queue of in-flight batches keeps memory flat however big the input is.
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.apply_async(_worker_encode, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def encode_texts(
    tokenizer: Tokenizer, dtype: np.dtype, texts: list[str]
) -> tuple[list[np.ndarray], int]:
    """Token arrays of `texts` (no special tokens added) and their size in utf-8 bytes."""
    documents = [np.array(ids, dtype=dtype) for ids in encode_ids(tokenizer, texts)]
    return documents, sum(len(text.encode("utf-8")) for text in texts)


_worker_state: tuple[Tokenizer, np.dtype] | None = None


def _worker_init(tokenizer_path: str, dtype: np.dtype) -> None:
    global _worker_state
    # One process per core already; Rust threads on top would oversubscribe the CPUs.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_state = (load_tokenizer(tokenizer_path), dtype)


def _worker_encode(texts: list[str]) -> tuple[list[np.ndarray], int]:
    return encode_texts(*_worker_state, texts)


class Progress:
    """One self-overwriting status line on stderr, refreshed at most twice a second."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.last = 0.0
        self.bytes = 0

    def update(self, documents: int, tokens: int, num_bytes: int) -> None:
        self.bytes += num_bytes
        now = time.monotonic()
        if now - self.last >= 0.5:
            self.last = now
            self._print(documents, tokens, end="\r")

    def finish(self, documents: int, tokens: int) -> None:
        self._print(documents, tokens, end="\n")

    def _print(self, documents: int, tokens: int, end: str) -> None:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.bytes / 2**20 / elapsed
        print(
            f"prepare: {documents:,} documents, {tokens:,} tokens, {rate:.1f} MB/s",
            end=end,
            file=sys.stderr,
            flush=True,
        )
