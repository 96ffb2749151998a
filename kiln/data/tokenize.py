"""Tokenizing documents in batches, in worker processes, in input order, with a progress line."""

from __future__ import annotations

import collections
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from kiln.data.tokenizer import encode_ids, load_tokenizer

BATCH_DOCUMENTS = 1024
BATCH_BYTES = 4 * 2**20


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


# How often progress is written when stderr is a file (a batch job's log), not a terminal.
LOG_FILE_INTERVAL_S = 30.0


class Progress:
    """A status line on stderr: rewritten in place twice a second on a terminal; in a log file,
    a new line every LOG_FILE_INTERVAL_S, without carriage returns."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.last = 0.0
        self.bytes = 0
        self.terminal = sys.stderr.isatty()

    def update(self, documents: int, tokens: int, num_bytes: int) -> None:
        self.bytes += num_bytes
        now = time.monotonic()
        if now - self.last >= (0.5 if self.terminal else LOG_FILE_INTERVAL_S):
            self.last = now
            # A terminal gets one line rewritten in place; a log file whole lines, now and then.
            self._print(documents, tokens, end="\r" if self.terminal else "\n")

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
