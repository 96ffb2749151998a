"""Token dataset: all shards read as one stream, cut into fixed-length samples; the shards are
memory-mapped local files or, for a URL, read with one byte-range request per sample
(`remote_shards.py`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.data.remote_shards import open_shards
from kiln.errors import KilnError

TOKEN_DTYPES = ("uint16", "uint32")


class TokenDataset:
    """Sample i is tokens[i*seq_len : i*seq_len + seq_len + 1]: the inputs plus the shifted labels.

    Consecutive samples share one token (the last label of i is the first input of i+1),
    so every token is predicted exactly once per pass. Samples may span shard boundaries.
    """

    def __init__(self, path: str | Path, seq_len: int) -> None:
        if seq_len <= 0:
            raise KilnError(f"seq_len must be positive, got {seq_len}")
        self._files = open_shards(path)
        # A local Path, or the URL as given (Path would fold its "//").
        self.path: Path | str = self._files.path
        self.seq_len = seq_len
        self._index = self._files.read_index()
        self._check_shards()
        self._dtype = np.dtype(self._index["dtype"]).newbyteorder("<")
        self._tokenizer = self._files.tokenizer(self._index["tokenizer_sha256"])
        sizes = [shard["num_tokens"] for shard in self._index["shards"]]
        # Global position of each shard's first token, plus the end of the stream.
        self._shard_starts = np.cumsum([0, *sizes], dtype=np.int64)
        if len(self) == 0:
            raise KilnError(
                f"dataset {self.path} has {self.num_tokens} tokens, too few for one sample of "
                f"seq_len {seq_len} (needs {seq_len + 1}); use a smaller seq_len or more data"
            )

    @property
    def vocab_size(self) -> int:
        return self._index["vocab_size"]

    @property
    def eos_id(self) -> int:
        return self._index["eos_id"]

    @property
    def tokenizer_path(self) -> Path:
        """The tokenizer the dataset was made with, as a local file (a remote one is copied)."""
        return self._tokenizer

    @property
    def num_tokens(self) -> int:
        return self._index["num_tokens"]

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.sample(i)

    def sample(self, i: int) -> np.ndarray:
        """Tokens of sample i as int64, length seq_len + 1."""
        return self.window(i, offset=0, length=self.seq_len)

    def window(self, i: int, *, offset: int, length: int) -> np.ndarray:
        """`length` + 1 tokens of sample i from `offset` on (a shorter sequence inside the
        sample: a sequence-length phase reads each sample as seq_len / length of them)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a dataset of {len(self)} samples")
        assert 0 <= offset <= self.seq_len - length, (offset, length, self.seq_len)
        start = i * self.seq_len + offset
        return self.read(start, start + length + 1)

    def read(self, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) of the concatenated stream as int64."""
        if not 0 <= start <= end <= self.num_tokens:
            raise IndexError(f"token range [{start}, {end}) outside [0, {self.num_tokens})")
        out = np.empty(end - start, dtype=np.int64)
        shard = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        pos = start
        # Loops over the (usually one or two) shards the range touches, never over tokens.
        while pos < end:
            shard_start = int(self._shard_starts[shard])
            stop = min(end, int(self._shard_starts[shard + 1]))
            file = self._index["shards"][shard]["file"]
            tokens = self._files.tokens(file, self._dtype, pos - shard_start, stop - shard_start)
            out[pos - start : stop - start] = tokens
            pos = stop
            shard += 1
        return out

    def document_starts(self) -> np.ndarray:
        """Global stream offset of every document's first token, as uint64."""
        parts = [
            self._files.load_array(shard["docs_file"]) + np.uint64(offset)
            for shard, offset in zip(self._index["shards"], self._shard_starts, strict=False)
        ]
        return np.concatenate(parts).astype(np.uint64)

    def _check_shards(self) -> None:
        """Catch truncated or mismatched files now rather than as garbage tokens mid-training."""
        index = self._index
        fix = "re-create it with `kiln prepare ... --overwrite`"
        if index["dtype"] not in TOKEN_DTYPES:
            raise KilnError(f"dataset {self.path} has unknown dtype {index['dtype']!r}; {fix}")
        if not index["shards"]:
            raise KilnError(f"dataset {self.path} has no shards; {fix}")
        self._files.check_files(index, np.dtype(index["dtype"]).newbyteorder("<"))
        if sum(shard["num_tokens"] for shard in index["shards"]) != index["num_tokens"]:
            raise KilnError(
                f"dataset {self.path}: shard token counts do not add up to num_tokens; {fix}"
            )
