"""`kiln prepare`: text / JSONL / Parquet files -> a tokenized, sharded dataset directory."""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from kiln.data.shards import DEFAULT_SHARD_TOKENS, ShardWriter
from kiln.data.tokenizer import encode_ids, load_tokenizer
from kiln.errors import KilnError

SUFFIXES = (".txt", ".jsonl", ".parquet")
BATCH_DOCUMENTS = 1024
BATCH_BYTES = 4 * 2**20


def prepare_dataset(
    inputs: list[str | Path],
    tokenizer_path: str | Path,
    output: str | Path,
    *,
    text_key: str = "text",
    num_workers: int | None = None,
    overwrite: bool = False,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
) -> Path:
    """Tokenize every document in `inputs` (files or directories, searched recursively).

    `.txt` files are one document each, `.jsonl` lines and `.parquet` rows are one document
    each (field / column `text_key`). `num_workers` tokenizer processes (default: one per
    CPU; 0 tokenizes in this process). Output is written atomically; returns its path.
    """
    files = find_input_files(inputs)
    workers = (os.cpu_count() or 1) if num_workers is None else num_workers
    batches = batched_texts(iter_texts(files, text_key))
    progress = Progress()
    with ShardWriter(
        output, tokenizer_path, shard_tokens=shard_tokens, overwrite=overwrite
    ) as writer:
        tokenized = tokenize_batches(batches, tokenizer_path, writer.dtype, workers)
        for documents, num_bytes in tokenized:
            for tokens in documents:
                writer.add_document(tokens)
            progress.update(writer.num_documents, writer.num_tokens, num_bytes)
    progress.finish(writer.num_documents, writer.num_tokens)
    return writer.path


def find_input_files(inputs: Iterable[str | Path]) -> list[Path]:
    """Expand files and directories into a sorted list of supported input files."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise KilnError(f"unsupported input file {path}: use {', '.join(SUFFIXES)} files")
            files.append(path)
        else:
            raise KilnError(f"input not found: {path}; pass existing files or directories")
    if not files:
        raise KilnError(
            f"no input files ({', '.join(SUFFIXES)}) found in {', '.join(map(str, inputs))}"
        )
    return files


def iter_texts(files: list[Path], text_key: str) -> Iterator[str]:
    """Every non-empty document of every file, in order."""
    readers = {".txt": read_txt, ".jsonl": read_jsonl, ".parquet": read_parquet}
    for file in files:
        try:
            for text in readers[file.suffix](file, text_key):
                if text:
                    yield text
        except (OSError, UnicodeDecodeError) as e:
            raise KilnError(f"cannot read input {file}: {e}") from None


def read_txt(path: Path, text_key: str) -> Iterator[str]:
    yield path.read_text(encoding="utf-8")


def read_jsonl(path: Path, text_key: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise KilnError(f"{path}:{line_number}: invalid JSON ({e})") from None
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise KilnError(
                    f"{path}:{line_number}: no string field {text_key!r}; "
                    "set text_key (--text-key) to the field that holds the text"
                )
            yield text


def read_parquet(path: Path, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise KilnError(
            f"reading {path} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:
        raise KilnError(f"cannot read parquet file {path}: {e}") from None
    if text_key not in parquet.schema_arrow.names:
        raise KilnError(
            f"{path} has no column {text_key!r} (columns: {', '.join(parquet.schema_arrow.names)}); "
            "set text_key (--text-key) to the column that holds the text"
        )
    for batch in parquet.iter_batches(columns=[text_key]):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


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
