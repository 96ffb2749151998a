"""Where a prepared dataset's files are read from, behind one small interface: a local folder
through np.memmap (`LocalShards`), or a URL (s3://, gs://, https://) through fsspec with one
byte-range read per sample (`RemoteShards`). Neither pickles open files or connections: each
process (a DataLoader worker too) opens its own on its first read."""

from __future__ import annotations

import hashlib
import io
import os
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from kiln import remote
from kiln.data.shards import INDEX_FILE, TOKENIZER_FILE, check_shard, parse_index, read_index
from kiln.errors import KilnError

# Tokens read from the head of the first shard at open: shows a wrong dtype or vocabulary, and a
# server that ignores range requests, for a few KB (the local check reads two windows per shard).
HEAD_TOKENS = 4096
# Tries of one range read before the step fails: a long run meets dropped connections.
READ_ATTEMPTS = 3
REUPLOAD = (
    "upload the whole folder `kiln prepare` wrote again, or re-create it with "
    "`kiln prepare ... --overwrite` and upload that"
)
LAYOUT = (
    "data.path must name the folder `kiln prepare` wrote, uploaded whole "
    f"({INDEX_FILE}, {TOKENIZER_FILE}, shard_*.bin, shard_*.docs.npy)"
)


def open_shards(path: str | Path) -> LocalShards | RemoteShards:
    """The reader of the dataset at `path`: a URL is read remotely, anything else locally."""
    if remote.is_url(path):
        return RemoteShards(str(path))
    return LocalShards(Path(path))


def tokenizer_cache() -> Path:
    """Folder of the local copies of remote datasets' tokenizers (the standard user cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kiln" / "remote"


class LocalShards:
    """A dataset folder on a local (or mounted) filesystem, memory-mapped shard by shard."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._memmaps: dict[str, np.memmap] = {}

    def read_index(self) -> dict[str, Any]:
        """The checked contents of index.json."""
        return read_index(self.path)

    def check_files(self, index: dict[str, Any], dtype: np.dtype) -> None:
        """Raise if a shard is missing, truncated, or holds ids outside the vocabulary."""
        for shard in index["shards"]:
            check_shard(self.path, shard, dtype, index["vocab_size"])

    def tokenizer(self, sha256: str) -> Path:
        """The dataset's tokenizer.json."""
        return self.path / TOKENIZER_FILE

    def tokens(self, file: str, dtype: np.dtype, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of shard `file`."""
        if file not in self._memmaps:
            self._memmaps[file] = np.memmap(self.path / file, dtype=dtype, mode="r")
        return self._memmaps[file][start:stop]

    def load_array(self, file: str) -> np.ndarray:
        """The array in .npy file `file`."""
        return np.load(self.path / file)

    def __getstate__(self) -> dict[str, Any]:
        # Workers map the files again rather than receive their data through a pipe.
        return {**self.__dict__, "_memmaps": {}}


class RemoteShards:
    """A dataset folder at a URL: each read is one ranged GET of just the bytes it needs."""

    def __init__(self, url: str) -> None:
        self.path = url.rstrip("/")
        self._fs: Any = None
        self._pid = -1
        self._arrays: dict[str, np.ndarray] = {}

    def read_index(self) -> dict[str, Any]:
        """The checked contents of index.json; a missing one says what data.path must name."""
        where = remote.join(self.path, INDEX_FILE)
        try:
            text = self._filesystem().cat_file(where)
        except KilnError:
            raise
        except FileNotFoundError as e:
            if self._lists_files():
                raise KilnError(
                    f"{self.path} is not a kiln dataset (no {INDEX_FILE}); {LAYOUT}"
                ) from None
            raise KilnError(f"{remote.reach_error(where, e)}; {LAYOUT}") from None
        except Exception as e:
            raise remote.reach_error(where, e) from None
        return parse_index(text, where=where, dataset=self.path)

    def check_files(self, index: dict[str, Any], dtype: np.dtype) -> None:
        """Raise if a shard's size is not what index.json says, or a docs file is missing: the
        sign of a shard changed since it was prepared. Reads no token data but a few KB."""
        names = [name for shard in index["shards"] for name in (shard["file"], shard["docs_file"])]
        sizes = self._sizes(names)
        for shard in index["shards"]:
            self._check_sizes(shard, dtype, sizes)
        self._check_head(index, dtype)

    def tokenizer(self, sha256: str) -> Path:
        """A local copy of tokenizer.json, checked against the index's hash: callers hash, load
        and copy it into checkpoints as a file. Keyed by URL and content, so every rank of a
        run uses the same tokenizer and a changed one is fetched anew."""
        key = hashlib.sha256(self.path.encode()).hexdigest()[:16]
        local = tokenizer_cache() / f"{key}-{sha256[:16]}" / TOKENIZER_FILE
        if local.is_file() and hashlib.sha256(local.read_bytes()).hexdigest() == sha256:
            return local
        url = remote.join(self.path, TOKENIZER_FILE)
        data = self._read_all(url)
        if hashlib.sha256(data).hexdigest() != sha256:
            raise KilnError(
                f"{url} is not the tokenizer {INDEX_FILE} records (its sha256 differs): it changed "
                f"since the dataset was prepared; {REUPLOAD}"
            )
        local.parent.mkdir(parents=True, exist_ok=True)
        partial = local.with_name(f".{local.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
        partial.write_bytes(data)
        os.replace(partial, local)  # atomic: the ranks of a machine may fetch it at once
        return local

    def tokens(self, file: str, dtype: np.dtype, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of shard `file`, with one range read."""
        url = remote.join(self.path, file)
        first, last = start * dtype.itemsize, stop * dtype.itemsize
        data = self._read_range(url, first, last)
        if len(data) != last - first:
            raise KilnError(
                f"{url}: asked for bytes [{first}, {last}) and got {len(data)} bytes: the server "
                "ignores HTTP range requests, or the file changed since start-up; serve the "
                "dataset from a store that honours them (S3, GCS and most HTTP servers do) or "
                f"copy it to local disk, and if it changed, {REUPLOAD}"
            )
        return np.frombuffer(data, dtype=dtype)

    def load_array(self, file: str) -> np.ndarray:
        """The array in .npy file `file`, read once per process."""
        if file not in self._arrays:
            data = self._read_all(remote.join(self.path, file))
            self._arrays[file] = np.load(io.BytesIO(data), allow_pickle=False)
        return self._arrays[file]

    def __getstate__(self) -> dict[str, Any]:
        # fsspec's async clients belong to the process that made them: a worker opens its own.
        return {**self.__dict__, "_fs": None, "_pid": -1, "_arrays": {}}

    def _filesystem(self) -> Any:
        """This process's filesystem, opened on first use and again after a fork."""
        if self._fs is None or self._pid != os.getpid():
            self._fs, self._pid = remote.filesystem(self.path), os.getpid()
        return self._fs

    def _read_all(self, url: str) -> bytes:
        try:
            return self._filesystem().cat_file(url)
        except KilnError:
            raise
        except Exception as e:
            raise remote.reach_error(url, e) from None

    def _read_range(self, url: str, first: int, last: int) -> bytes:
        for attempt in range(READ_ATTEMPTS):
            try:
                return self._filesystem().cat_file(url, start=first, end=last)
            except KilnError:
                raise
            except Exception as e:
                if isinstance(e, FileNotFoundError) or attempt + 1 == READ_ATTEMPTS:
                    raise remote.reach_error(url, e) from None
                time.sleep(2**attempt)  # a transient failure: a dropped connection, throttling
        raise AssertionError("unreachable")

    def _lists_files(self) -> bool:
        """Whether the dataset folder exists and holds something (so only index.json is missing)."""
        try:
            return bool(self._filesystem().ls(self.path))
        except Exception:
            return False

    def _sizes(self, names: list[str]) -> dict[str, int | None]:
        """Bytes of each file (None: missing): one listing of the folder where the store lists
        (S3, GCS), one HEAD request per file over HTTP, which has no listing."""
        fs = self._filesystem()
        if remote.protocol(self.path) in ("http", "https"):
            return {name: self._size_of(remote.join(self.path, name)) for name in names}
        fs.invalidate_cache(self.path)  # a listing cached earlier in this process may be stale
        try:
            listing = fs.ls(self.path, detail=True)
        except Exception as e:
            raise remote.reach_error(self.path, e) from None
        found = {entry["name"].rstrip("/").rsplit("/", 1)[-1]: entry["size"] for entry in listing}
        return {name: found.get(name) for name in names}

    def _size_of(self, url: str) -> int | None:
        try:
            size = self._filesystem().info(url).get("size")
        except FileNotFoundError:
            return None
        except Exception as e:
            raise remote.reach_error(url, e) from None
        if size is None:
            raise KilnError(
                f"{url}: the server does not report its size (no Content-Length), which kiln "
                "checks against index.json before training; serve it from a server that does"
            )
        return int(size)

    def _check_sizes(self, shard: dict[str, Any], dtype: np.dtype, sizes: dict) -> None:
        expected = shard["num_tokens"] * dtype.itemsize
        found = sizes[shard["file"]]
        if found != expected:
            state = "is missing" if found is None else f"is {found} bytes"
            raise KilnError(
                f"dataset {self.path}: shard {shard['file']} {state}, but {INDEX_FILE} says "
                f"{expected} bytes ({shard['num_tokens']} {dtype.name} tokens): it changed "
                f"since the dataset was prepared; {REUPLOAD}"
            )
        docs = sizes[shard["docs_file"]]
        if docs is None or docs < 8 * shard["num_documents"]:
            state = "is missing" if docs is None else f"is {docs} bytes"
            raise KilnError(
                f"dataset {self.path}: {shard['docs_file']} {state}, too small for the "
                f"{shard['num_documents']} document starts {INDEX_FILE} records; {REUPLOAD}"
            )

    def _check_head(self, index: dict[str, Any], dtype: np.dtype) -> None:
        shard = next((s for s in index["shards"] if s["num_tokens"]), None)
        if shard is None:
            return
        head = self.tokens(shard["file"], dtype, 0, min(HEAD_TOKENS, shard["num_tokens"]))
        if int(head.max()) >= index["vocab_size"]:
            raise KilnError(
                f"dataset {self.path}: shard {shard['file']} holds token id {int(head.max())}, "
                f"outside the vocabulary of its tokenizer (vocab_size {index['vocab_size']}); "
                f"{REUPLOAD}"
            )


def remote_dataset_exists(url: str) -> bool:
    """Whether a dataset's index.json is at `url` (an unreachable store is an error)."""
    where = remote.join(url, INDEX_FILE)
    try:
        return bool(remote.filesystem(url).exists(where))
    except KilnError:
        raise
    except Exception as e:
        raise remote.reach_error(where, e) from None
