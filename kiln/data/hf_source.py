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
    of seq_len + 1 tokens that overlap by one. Only the share is read and tokenized.

    Every token of the share is a target once: the stream opens with the input of its first
    target (an end-of-document token, or the token before it in a row continued from another
    rank count), and a row continued in the middle of the stream is preceded by its own input,
    which is not a target there (`take` says where)."""

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
        # Rows not fully read yet, as (row, index in the row of the first token held, tokens from
        # there, whether that first token is a target): the first starts the next window at
        # self._offset.
        self._pending: deque[tuple[int, int, np.ndarray, bool]] = deque()
        self._offset, self._saved = 0, position
        self._documents = self._read_documents(first=position.document, trained=position.trained)
        self._fill(1)
        return note

    def position(self) -> dict[str, Any]:
        """This rank's place (a `stream_share.Position`): the next row not fully trained on, the
        token of it the next window starts with, windows taken."""
        if self._sample == self._saved.sample:  # no window taken since the seek
            return dict(self._saved.__dict__)
        row, base, _, _ = self._pending[0]
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

    def take(self) -> tuple[np.ndarray, list[int]]:
        """This rank's next window, and the positions among its targets (window[1:]) that are
        not targets: the inputs put before rows continued from another rank count."""
        need = self.seq_len + 1
        self._fill(need)
        # Only the pieces the window takes: a long document stays pending for many windows.
        pieces, untrained, start, left = [], [], self._offset, need
        for _, _, tokens, target in self._pending:
            if pieces and not target:
                untrained.append(need - left - 1)
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
        return window.astype(np.int64), untrained

    def _fill(self, need: int) -> None:
        """Read documents until the pending ones hold `need` tokens past the offset."""
        while sum(len(t) for _, _, t, _ in self._pending) - self._offset < need:
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

    def _read_documents(
        self, *, first: int, trained: int
    ) -> Iterator[tuple[int, int, np.ndarray, bool]]:
        """The pending entries of this rank's share from row `first` (whose first `trained`
        tokens were targets) on: each row from the input of its first target not yet trained.
        Empty rows are documents of no tokens (not even an EOS, as `kiln prepare` drops them), so
        document numbers are the dataset's row numbers."""
        rows = self.dataset.select_columns([self.entry.text_key])
        share = self.layout.share(self.data_rank, first=first)
        starts, opening = {first: trained}, True
        while True:
            chunk = list(itertools.islice(share, STREAM_ROWS))
            chunk = [(row, starts.pop(row, done)) for row, done in chunk if row < len(rows)]
            if not chunk:
                return
            texts = [text or "" for text in rows[[row for row, _ in chunk]][self.entry.text_key]]
            for (row, done), tokens in zip(chunk, self._encode(texts), strict=True):
                # Each first target gets its own input: a row not begun follows an EOS (the row
                # before's, or one put first); a row begun elsewhere gets the token before back,
                # which opens the stream or, held in the middle of it, is no target here.
                if opening:  # even with nothing left to train: a resume there starts at its EOS
                    opening = False
                    if done:
                        yield row, done - 1, tokens[done - 1 :], False
                    else:
                        yield row, -1, np.array([self.eos_id, *tokens], dtype=np.int64), False
                elif done < len(tokens):
                    yield row, max(done - 1, 0), tokens[max(done - 1, 0) :], not done

    def _encode(self, texts: list[str]) -> list[np.ndarray]:
        ids = encode_ids(self.tokenizer, texts)
        return [
            np.array([*tokens, self.eos_id] if text else [], dtype=np.int64)
            for text, tokens in zip(texts, ids, strict=True)
        ]

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a streaming source is read in the training process only")
