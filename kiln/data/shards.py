"""On-disk token dataset: raw token shards + document offsets + `index.json`, written atomically.

Layout of a dataset directory:

    index.json              format, version, dtype, vocab_size, eos_id, tokenizer_sha256,
                            num_tokens, num_documents, shards: [{file, docs_file, num_tokens, num_documents}],
                            plus the writer's extra keys (`kiln prepare`: sources, prepare, val)
    tokenizer.json          copy of the tokenizer that produced the tokens
    shard_00000.bin         raw token array (uint16 or uint32, little-endian), np.memmap-able
    shard_00000.docs.npy    uint64 start offset of every document within the shard

Every document is followed by the eos token; documents never straddle shards.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np

from kiln.data.tokenizer import eos_id, load_tokenizer, tokenizer_hash
from kiln.errors import KilnError

FORMAT_NAME = "kiln-tokens"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.json"
DEFAULT_SHARD_TOKENS = 64 * 2**20
# Tokens at each end of a shard whose ids are checked against the vocabulary when it is opened.
CHECK_TOKENS = 2**16
REMAKE = "re-create it with `kiln prepare ... --overwrite`"
INDEX_KEYS = ("dtype", "vocab_size", "eos_id", "tokenizer_sha256", "num_tokens", "shards")
SHARD_KEYS = ("file", "docs_file", "num_tokens", "num_documents")


class DatasetExistsError(KilnError):
    """The output directory is already taken (possibly by a concurrent writer that finished first)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every token id: uint16 halves disk and page-cache use."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def shard_file_names(index: int) -> tuple[str, str]:
    """(tokens file, document offsets file) of shard number `index`."""
    stem = f"shard_{index:05d}"
    return f"{stem}.bin", f"{stem}.docs.npy"


class ShardWriter:
    """Writes documents (lists of token ids) into a dataset directory, all or nothing.

    Use as a context manager. Everything goes to a hidden temporary sibling directory
    that is renamed to `output` only when the `with` block ends without an exception,
    so a crash or Ctrl-C never leaves a half-written dataset behind.
    """

    def __init__(
        self,
        output: str | Path,
        tokenizer_path: str | Path,
        *,
        shard_tokens: int = DEFAULT_SHARD_TOKENS,
        overwrite: bool = False,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        if shard_tokens <= 0:
            raise KilnError(f"shard_tokens must be positive, got {shard_tokens}")
        self.path = Path(output)
        self.tokenizer_path = Path(tokenizer_path)
        self.shard_tokens = shard_tokens
        self.overwrite = overwrite
        # Extra index keys; may be filled in until the `with` block ends.
        self.metadata = dict(metadata or {})
        tokenizer = load_tokenizer(self.tokenizer_path)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos_id(tokenizer)
        self.dtype = token_dtype(self.vocab_size)
        self.num_tokens = 0
        self.num_documents = 0
        check_output_free(self.path, overwrite)
        self._tmp: Path | None = None
        self._shards: list[dict[str, Any]] = []
        self._file: BinaryIO | None = None
        self._doc_starts: list[int] = []
        self._shard_len = 0

    def __enter__(self) -> ShardWriter:
        self._tmp = _make_sibling_dir(self.path, "tmp")
        return self

    @property
    def staging_dir(self) -> Path:
        """The temporary directory that becomes `path`: a nested dataset written here is
        published together with this one."""
        if self._tmp is None:
            raise RuntimeError("staging_dir exists only inside `with ShardWriter(...)`")
        return self._tmp

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is None:
                self._close_shard()
                self._finish()
        finally:
            if self._file is not None:
                self._file.close()
            if self._tmp is not None and self._tmp.exists():
                shutil.rmtree(self._tmp, ignore_errors=True)

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document; the eos token is added after it."""
        if self._tmp is None:
            raise RuntimeError(
                "ShardWriter must be used as a context manager (`with ShardWriter(...)`)"
            )
        array = np.asarray(tokens)
        if array.size and (array.min() < 0 or array.max() >= self.vocab_size):
            raise KilnError(
                f"token id out of range [0, {self.vocab_size}) in document {self.num_documents}; "
                "tokenize with the same tokenizer that was given to the writer"
            )
        if self._file is None or self._shard_len >= self.shard_tokens:
            self._open_shard()
        self._doc_starts.append(self._shard_len)
        self._file.write(array.astype(self.dtype, copy=False).tobytes())
        self._file.write(np.array([self.eos_id], dtype=self.dtype).tobytes())
        added = array.size + 1
        self._shard_len += added
        self.num_tokens += added
        self.num_documents += 1

    def _open_shard(self) -> None:
        self._close_shard()
        tokens_file, _ = shard_file_names(len(self._shards))
        self._file = open(self._tmp / tokens_file, "wb")  # noqa: SIM115 - closed in _close_shard
        self._doc_starts = []
        self._shard_len = 0

    def _close_shard(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        tokens_file, docs_file = shard_file_names(len(self._shards))
        np.save(self._tmp / docs_file, np.array(self._doc_starts, dtype=np.uint64))
        self._shards.append(
            {
                "file": tokens_file,
                "docs_file": docs_file,
                "num_tokens": self._shard_len,
                "num_documents": len(self._doc_starts),
            }
        )

    def _finish(self) -> None:
        if self.num_documents == 0:
            raise KilnError(
                f"no documents were written to {self.path}; check that the inputs contain text"
            )
        shutil.copyfile(self.tokenizer_path, self._tmp / TOKENIZER_FILE)
        index = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "dtype": self.dtype.name,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "tokenizer_sha256": tokenizer_hash(self.tokenizer_path),
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "shards": self._shards,
            **self.metadata,
        }
        (self._tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        self._publish()

    def _publish(self) -> None:
        """Move the finished temporary directory into place with one rename."""
        old = None
        if _is_occupied(self.path):
            check_output_free(self.path, self.overwrite)
            # Move the old dataset aside first: rename cannot replace a non-empty directory.
            old = _make_sibling_dir(self.path, "old")
            os.rename(self.path, old / "data")
        try:
            os.rename(self._tmp, self.path)
        except OSError:
            if _is_occupied(self.path):
                raise DatasetExistsError(
                    f"{self.path} was created by another process while this one was writing; "
                    "use that dataset or write to another output"
                ) from None
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def check_output_free(path: Path, overwrite: bool) -> None:
    """Raise unless a dataset may be written at `path`: new, empty, or a dataset to overwrite."""
    if _is_occupied(path) and not overwrite:
        raise DatasetExistsError(
            f"output directory {path} already exists and is not empty; "
            "choose another output or pass overwrite=True (--overwrite) to replace it"
        )
    if _is_occupied(path) and not (path / INDEX_FILE).is_file():
        # Refuse to delete something that is not a dataset, e.g. `--output .` by mistake.
        raise KilnError(
            f"refusing to overwrite {path}: it is not a kiln dataset (no {INDEX_FILE}); "
            "choose an empty or new output directory"
        )


def read_index(path: str | Path) -> dict[str, Any]:
    """Load and check `index.json` of a dataset directory; KilnError says how to fix a bad one."""
    path = Path(path)
    if path.is_file():
        # Training reads token shards, not text: say so rather than "not found".
        output = Path("data") / path.stem
        raise KilnError(
            f"{path} is a file, and training reads a dataset directory of token shards: "
            f"prepare it with `kiln prepare --input {path} --tokenizer tokenizer.json "
            f"--output {output}` (or --train-tokenizer VOCAB_SIZE instead of --tokenizer), "
            f"then set data.path={output}"
        )
    if not path.is_dir():
        raise KilnError(
            f"dataset directory not found: {path}; create one with `kiln prepare --input ... "
            f"--tokenizer tokenizer.json --output {path}` or use the built-in demo corpus "
            '(data.source = "demo")'
        )
    index_path = path / INDEX_FILE
    if not index_path.is_file():
        raise KilnError(
            f"{path} is not a kiln dataset (no {INDEX_FILE}); create one with "
            f"`kiln prepare --input ... --tokenizer ... --output {path}`"
        )
    try:
        text = index_path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise KilnError(f"{index_path} is unreadable or corrupt ({e}); {REMAKE}") from None
    return parse_index(text, where=str(index_path), dataset=str(path))


def parse_index(text: str | bytes, *, where: str, dataset: str) -> dict[str, Any]:
    """Parse and check the text of an `index.json` (`where` names it in messages)."""
    try:
        index = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KilnError(f"{where} is unreadable or corrupt ({e}); {REMAKE}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT_NAME:
        raise KilnError(f"{where} is not a kiln dataset index; {REMAKE}")
    if index.get("version") != FORMAT_VERSION:
        raise KilnError(
            f"{dataset} uses dataset format version {index.get('version')}, this kiln reads "
            f"version {FORMAT_VERSION}; {REMAKE}"
        )
    missing = [key for key in INDEX_KEYS if key not in index]
    missing += [key for shard in index.get("shards", []) for key in SHARD_KEYS if key not in shard]
    if missing:
        raise KilnError(f"{where} is corrupt (missing {', '.join(sorted(set(missing)))}); {REMAKE}")
    return index


def check_shard(path: Path, shard: dict[str, Any], dtype: np.dtype, vocab_size: int) -> None:
    """Raise if a shard's files are missing, truncated, or hold ids outside the vocabulary."""
    expected = shard["num_tokens"] * dtype.itemsize
    file = path / shard["file"]
    if not file.is_file() or file.stat().st_size != expected:
        raise KilnError(
            f"dataset {path}: shard {shard['file']} is missing or not {expected} bytes; {REMAKE}"
        )
    _check_docs_file(path, shard)
    if shard["num_tokens"]:
        _check_token_sample(path, shard, dtype, vocab_size)


def _check_docs_file(path: Path, shard: dict[str, Any]) -> None:
    file = path / shard["docs_file"]
    count = shard["num_documents"]
    try:
        starts = np.load(file, mmap_mode="r")
        valid = starts.shape == (count,) and starts.dtype == np.uint64
        valid = valid and (count == 0 or (starts[0] == 0 and starts[-1] < shard["num_tokens"]))
    except (OSError, ValueError, EOFError):  # EOFError: an empty file
        valid = False
    if not valid:
        raise KilnError(
            f"dataset {path}: {shard['docs_file']} is missing, truncated or does not match "
            f"{INDEX_FILE} ({count} document starts expected); {REMAKE}"
        )


def _check_token_sample(
    path: Path, shard: dict[str, Any], dtype: np.dtype, vocab_size: int
) -> None:
    # Only the ends of each shard: a full scan runs at about 2 GB/s from a local disk, on every
    # rank at every start, which is too slow for large datasets. A wrong dtype, vocabulary or
    # file shows in any window; corruption in the middle of a shard is not caught here.
    tokens = np.memmap(path / shard["file"], dtype=dtype, mode="r")
    largest = max(int(tokens[:CHECK_TOKENS].max()), int(tokens[-CHECK_TOKENS:].max()))
    if largest >= vocab_size:
        raise KilnError(
            f"dataset {path}: shard {shard['file']} holds token id {largest}, outside the "
            f"vocabulary of its tokenizer (vocab_size {vocab_size}); {REMAKE}"
        )


def _make_sibling_dir(path: Path, tag: str) -> Path:
    """A new hidden directory next to `path`, on the same filesystem so rename is atomic."""
    # Not tempfile.mkdtemp: its 0700 mode would make the published dataset unreadable to others.
    sibling = path.parent / f".{path.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    sibling.mkdir(parents=True)
    return sibling


def _is_occupied(path: Path) -> bool:
    """True if `path` exists and is not an empty directory (an empty one can be renamed over)."""
    if not path.exists():
        return False
    return not path.is_dir() or any(path.iterdir())
