"""Hugging Face `datasets` as training data, local only: a folder written by `save_to_disk`, or
`hf:NAME[:CONFIG]` already in the local cache (read offline, never downloaded).

Eager: tokenized once at start-up into a prepared dataset under the run's data cache, then read
like any prepared dataset (shuffled, worker processes). Streaming: tokenized while training, in
document order, packed into windows of seq_len + 1; its position (next sample, document, offset
in it) is saved in checkpoints, and a resume skips straight to that document.
"""

from __future__ import annotations

import hashlib
import itertools
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
from kiln.data.stream_share import resume_positions
from kiln.data.tokenize import batched_texts, tokenize_batches
from kiln.data.tokenizer import encode_ids, eos_id, load_tokenizer, tokenizer_hash
from kiln.errors import KilnError
from kiln.log import info

# Rows a streaming rank reads and tokenizes at once: enough for the tokenizer's batch call to pay,
# few enough that a rank does not tokenize far ahead of what its steps take.
STREAM_ROWS = 64


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
    """Data rank `data_rank` of `data_ranks`: its share of the dataset's rows (`stream_share.py`),
    tokenized in order, each document followed by the end-of-document token, packed into windows
    of seq_len + 1 tokens that overlap by one. Only the share is read and tokenized."""

    streaming = True

    def __init__(
        self,
        entry: DatasetSource,
        *,
        tokenizer_path: str,
        seq_len: int,
        data_rank: int = 0,
        data_ranks: int = 1,
    ):
        self.entry, self.seq_len = entry, seq_len
        self.data_rank, self.data_ranks = data_rank, data_ranks
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.eos_id = eos_id(self.tokenizer)
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.dataset = open_hf_dataset(entry.path, entry.split)
        check_text_column(self.dataset, entry.text_key, entry.path)
        self.seek(None)

    def seek(self, saved: dict[str, Any] | None) -> str | None:
        """Continue a `gathered_state` of every rank (None: at the start); returns what was done
        when it was saved by another number of data ranks."""
        self._check_same_rows(saved)
        self.layout, positions, note = resume_positions(saved, self.data_ranks)
        position = positions[self.data_rank]
        self._sample = position.sample
        # Documents not fully read yet, as (row, first token held, tokens from there): the first
        # starts the next window at self._offset.
        self._pending: deque[tuple[int, int, np.ndarray]] = deque()
        self._offset, self._saved = 0, position
        self._documents = self._read_documents(first=position.document, offset=position.offset)
        self._fill(1)
        return note

    def position(self) -> dict[str, Any]:
        """This rank's place: the next row not fully read, the tokens of it read, windows taken."""
        if not self._pending:  # the share was read to its end before this run
            return {**self._saved.__dict__, "sample": self._sample}
        row, base, _ = self._pending[0]
        return {"document": row, "offset": base + self._offset, "sample": self._sample}

    def gathered_state(self, positions: list[dict[str, Any]]) -> dict[str, Any]:
        """What a checkpoint keeps: the layout and every data rank's `position()`, in rank order,
        and the dataset's fingerprint, since positions are row numbers."""
        state = {**self.layout.to_state(), "positions": positions}
        return {**state, "fingerprint": self.dataset._fingerprint}

    def _check_same_rows(self, saved: dict[str, Any] | None) -> None:
        """Refuse positions saved over other rows: a Hub dataset with a new revision or files at
        a URL that changed would put them on other documents, repeating some and skipping others."""
        saved_print = (saved or {}).get("fingerprint")
        if saved_print is not None and saved_print != self.dataset._fingerprint:
            raise KilnError(
                f"streaming dataset {self.entry.path} ({self.entry.split}) is not the one this "
                f"checkpoint was streaming (fingerprint {saved_print}, now "
                f"{self.dataset._fingerprint}): its saved positions are row numbers and would "
                "point at other documents. Resume with the same data (a Hub dataset at the "
                "revision the run started with), or start a new run from the checkpoint's "
                "weights (checkpoint.load_path with checkpoint.model_only = true)"
            )

    def take(self) -> np.ndarray:
        """This rank's next window."""
        need = self.seq_len + 1
        self._fill(need)
        # Only the pieces the window takes: a long document stays pending for many windows.
        pieces, start, left = [], self._offset, need
        for _, _, tokens in self._pending:
            pieces.append(tokens[start : start + left])
            left, start = left - len(pieces[-1]), 0
            if not left:
                break
        window = np.concatenate(pieces)
        self._offset += self.seq_len
        # The window left a token of the last document it touched: something stays pending.
        while self._offset >= len(self._pending[0][2]):
            self._offset -= len(self._pending.popleft()[2])
        self._sample += 1
        return window.astype(np.int64)

    def _fill(self, need: int) -> None:
        """Read documents until the pending ones hold `need` tokens past the offset."""
        while sum(len(t) for _, _, t in self._pending) - self._offset < need:
            try:
                self._pending.append(next(self._documents))
            except StopIteration:
                if need == 1:
                    return  # all read: the next take() reports the end
                raise KilnError(
                    f"streaming dataset {self.entry.path} ran out on data rank {self.data_rank} "
                    f"after {self._sample} samples; use streaming = false (eager data repeats "
                    "in new epochs) or more data"
                ) from None

    def _read_documents(self, *, first: int, offset: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """(row, first token kept, tokens) of this rank's share from row `first` (whose first
        `offset` tokens were read) on. Empty rows are documents of no tokens (not even an EOS,
        as `kiln prepare` drops them), so document numbers are the dataset's row numbers."""
        rows = self.dataset.select_columns([self.entry.text_key])
        share = self.layout.share(self.data_rank, first=first)
        starts = {first: offset}
        while True:
            chunk = list(itertools.islice(share, STREAM_ROWS))
            chunk = [(row, starts.pop(row, read)) for row, read in chunk if row < len(rows)]
            if not chunk:
                return
            texts = [text or "" for text in rows[[row for row, _ in chunk]][self.entry.text_key]]
            for (row, read), tokens in zip(chunk, self._encode(texts), strict=True):
                yield row, read, tokens[read:]

    def _encode(self, texts: list[str]) -> list[np.ndarray]:
        ids = encode_ids(self.tokenizer, texts)
        return [
            np.array([*tokens, self.eos_id] if text else [], dtype=np.int64)
            for text, tokens in zip(texts, ids, strict=True)
        ]

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a streaming source is read in the training process only")
