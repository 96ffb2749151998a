"""Hugging Face `datasets` as training data, local only: a folder written by `save_to_disk`, or
`hf:NAME[:CONFIG]` already in the local cache (read offline, never downloaded).

Eager: tokenized once at start-up into a prepared dataset under the run's data cache, then read
like any prepared dataset (shuffled, worker processes). Streaming: tokenized while training, in
document order, packed into windows of seq_len + 1; its position (next sample, document, offset
in it) is saved in checkpoints, and a resume skips straight to that document.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kiln.config.sections import DatasetSource
from kiln.data.hf_datasets import check_text_column, dataset_texts, open_hf_dataset
from kiln.data.shards import ShardWriter
from kiln.data.tokenize import batched_texts, tokenize_batches
from kiln.data.tokenizer import encode_ids, eos_id, load_tokenizer, tokenizer_hash
from kiln.errors import KilnError
from kiln.log import info

ENCODE_BATCH = 256


def hf_cache_path(entry: DatasetSource, *, tokenizer_path: str, cache_dir: Path) -> Path:
    """Where the eager tokenization of `entry` lives: keyed by the data, split, column and
    tokenizer, so a change of any of them tokenizes again."""
    dataset = open_hf_dataset(entry.path, entry.split)
    key = json.dumps(
        [
            entry.path,
            entry.split,
            entry.text_key,
            dataset._fingerprint,
            tokenizer_hash(tokenizer_path),
        ]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{entry.name}-{digest}"


def prepare_hf_cache(entry: DatasetSource, *, tokenizer_path: str, cache_dir: Path) -> Path:
    """Tokenize `entry` into a prepared dataset unless the cache already holds it."""
    output = hf_cache_path(entry, tokenizer_path=tokenizer_path, cache_dir=cache_dir)
    if (output / "index.json").is_file():
        return output
    dataset = open_hf_dataset(entry.path, entry.split)
    check_text_column(dataset, entry.text_key, entry.path)
    texts = (text for text in dataset_texts(dataset, entry.text_key) if text)
    info(f"tokenizing {entry.path} ({entry.split}) into {output}", stdout=True)
    with ShardWriter(output, tokenizer_path) as writer:
        for documents, _ in tokenize_batches(
            batched_texts(texts), tokenizer_path, writer.dtype, workers=os.cpu_count() or 1
        ):
            for tokens in documents:
                writer.add_document(tokens)
    return output


class StreamingSamples:
    """Sample k = stream tokens [k·seq_len, k·seq_len + seq_len + 1) of the documents in order,
    each followed by the end-of-document token. Read strictly in order (`take`)."""

    streaming = True

    def __init__(self, entry: DatasetSource, *, tokenizer_path: str, seq_len: int):
        self.entry, self.seq_len = entry, seq_len
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.eos_id = eos_id(self.tokenizer)
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.seek(None)

    def seek(self, state: dict[str, int] | None) -> None:
        """Continue at a `position()`; None: at the start."""
        state = state or {"sample": 0, "document": 0, "offset": 0}
        self._sample, self._document, self._offset = (
            state["sample"],
            state["document"],
            state["offset"],
        )
        # Documents not yet fully consumed; the first starts the next sample at self._offset.
        self._pending: deque[np.ndarray] = deque()
        self._documents = self._read_documents(start=self._document)

    def position(self) -> dict[str, int]:
        return {"sample": self._sample, "document": self._document, "offset": self._offset}

    def take(self, k: int) -> np.ndarray:
        """Sample k; samples before it that were not taken are read and dropped."""
        assert k >= self._sample, f"streaming samples are read in order ({k} < {self._sample})"
        while self._sample < k:
            self._next_window()
        return self._next_window()

    def _next_window(self) -> np.ndarray:
        need = self.seq_len + 1
        while sum(len(d) for d in self._pending) - self._offset < need:
            self._pending.append(self._next_document())
        window = np.concatenate(list(self._pending))[self._offset : self._offset + need]
        self._offset += self.seq_len
        while self._offset >= len(self._pending[0]):
            self._offset -= len(self._pending.popleft())
            self._document += 1
        self._sample += 1
        return window.astype(np.int64)

    def _next_document(self) -> np.ndarray:
        try:
            return next(self._documents)
        except StopIteration:
            raise KilnError(
                f"streaming dataset {self.entry.path} ran out after {self._sample} samples; "
                "use streaming = false (eager data repeats in new epochs) or more data"
            ) from None

    def _read_documents(self, *, start: int) -> Iterator[np.ndarray]:
        dataset = open_hf_dataset(self.entry.path, self.entry.split)
        check_text_column(dataset, self.entry.text_key, self.entry.path)
        batch: list[str] = []
        # Empty rows stay, as documents of no tokens (not even an EOS, as `kiln prepare` drops
        # them), so document numbers are the dataset's row numbers.
        for text in dataset_texts(dataset, self.entry.text_key, start=start):
            batch.append(text or "")
            if len(batch) == ENCODE_BATCH:
                yield from self._encode(batch)
                batch = []
        yield from self._encode(batch)

    def _encode(self, texts: list[str]) -> Iterator[np.ndarray]:
        for text, ids in zip(texts, encode_ids(self.tokenizer, texts), strict=True):
            yield np.array([*ids, self.eos_id] if text else [], dtype=np.int64)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a streaming source is read in the training process only")
