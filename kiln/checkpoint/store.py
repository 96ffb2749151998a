"""Where checkpoints are kept: a local (or shared) filesystem, or an object store reached through
fsspec (`s3://`, `gs://`, ...). `kiln/checkpoint/layout.py` states the rules of a checkpoint
directory once, over the `CheckpointStore` protocol; each store says how it commits.

A location is a `Path` on a filesystem and an `ObjectPath` (a URL) in an object store; both join
with `/` and have `.name` and `.parent`, so the layout code reads the same for both.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kiln.errors import KilnError
from kiln.remote import is_url

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageReader, StorageWriter


MARKER = "COMPLETE"  # a checkpoint's commit marker: its step and every file with its size


@dataclass(frozen=True, order=True)
class ObjectPath:
    """A key prefix or object in an object store, as a URL without a trailing slash."""

    url: str

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(f"{self.url}/{name}")

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.url.rsplit("/", 1)[0])

    def __str__(self) -> str:
        return self.url


Location = Path | ObjectPath


def location(value: str | os.PathLike | ObjectPath) -> Location:
    """A configured checkpoint location: a URL becomes an ObjectPath, anything else a Path."""
    if isinstance(value, ObjectPath | Path):
        return value
    text = os.fspath(value)
    return ObjectPath(text.rstrip("/")) if is_url(text) else Path(text)


class StoreError(OSError):
    """An object store could not be reached or refused a request: an OSError, so a failed save
    is reported on every rank like a full disk."""


class CheckpointStore(Protocol):
    """The operations the checkpoint layout needs from where it keeps its files."""

    def staging(self, root: Location, step: int) -> Location:
        """Where the save of `step` is written before its commit."""

    def partials(self, root: Location) -> list[Location]:
        """Leftovers of saves that died before their commit."""

    def publish(self, root: Location, step: int, marker: str, latest: str) -> Location:
        """Make the staged save of `step` the committed one: its marker (text `marker`), then
        `latest` (text `latest`); the committed folder."""

    def exists(self, path: Location) -> bool: ...

    def is_file(self, path: Location) -> bool: ...

    def children(self, path: Location) -> list[Location]: ...

    def files(self, path: Location) -> dict[str, int]:
        """Every file under `path`, by its name relative to `path`, with its size in bytes."""

    def read_bytes(self, path: Location) -> bytes: ...

    def write_bytes(self, path: Location, data: bytes) -> None:
        """Write a whole file (made durable by the commit)."""

    def write_own(self, path: Location, data: bytes) -> None:
        """Write a whole file that only this rank writes, durable when this returns."""

    def remove(self, path: Location) -> None:
        """Delete a checkpoint folder (a missing one is fine); its marker goes first."""

    def remove_file(self, path: Location) -> None:
        """Delete one file (a missing one is fine)."""

    def check_writable(self, root: Location) -> None:
        """Write and delete a probe under `root`, leaving nothing behind; a KilnError saying
        what is wrong otherwise."""

    def writer(self, path: Location) -> StorageWriter: ...

    def reader(self, path: Location) -> StorageReader: ...


class LocalStore:
    """A filesystem: a save is written into a hidden partial folder, fsynced, marked and renamed
    into place, so a commit is atomic and survives a power cut."""

    def staging(self, root: Location, step: int) -> Path:
        return Path(root) / f".step_{step:08d}.partial"

    def partials(self, root: Location) -> list[Location]:
        root = Path(root)
        return sorted(root.glob(".step_*.partial")) if root.is_dir() else []

    def publish(self, root: Location, step: int, marker: str, latest: str) -> Path:
        """Durable: every file and folder the checkpoint depends on reaches the disk before the
        rename publishes it, and the rename and `latest` before this returns. Without the fsyncs
        a power cut or a spot VM's hard stop right after a commit can leave the small files
        empty behind names that were already renamed into place."""
        root, partial = Path(root), self.staging(root, step)
        final = root / f"step_{step:08d}"
        for file in sorted(p for p in partial.rglob("*") if p.is_file()):
            sync_path(file)
        for folder in sorted((p for p in partial.rglob("*") if p.is_dir()), reverse=True):
            sync_path(folder)
        _replace_synced(partial / MARKER, marker)
        sync_path(partial)
        if final.exists():
            shutil.rmtree(final)
        os.rename(partial, final)
        sync_path(root)
        _replace_synced(root / "latest", latest)
        sync_path(root)
        return final

    def exists(self, path: Location) -> bool:
        return Path(path).exists()

    def is_file(self, path: Location) -> bool:
        return Path(path).is_file()

    def children(self, path: Location) -> list[Location]:
        path = Path(path)
        return sorted(path.iterdir()) if path.is_dir() else []

    def files(self, path: Location) -> dict[str, int]:
        path = Path(path)
        return {
            str(file.relative_to(path)): file.stat().st_size
            for file in sorted(path.rglob("*"))
            if file.is_file()
        }

    def read_bytes(self, path: Location) -> bytes:
        return Path(path).read_bytes()

    def write_bytes(self, path: Location, data: bytes) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def write_own(self, path: Location, data: bytes) -> None:
        """Write and fsync a file by its writer (on a shared filesystem another node's fsync may
        not reach it), replacing it whole: a reader sees the old or the new, never a part."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _replace_synced(path, data)

    def remove(self, path: Location) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def remove_file(self, path: Location) -> None:
        Path(path).unlink(missing_ok=True)

    def check_writable(self, root: Location) -> None:
        root = Path(root)
        created = missing_folders(root)
        probe = root / probe_name()
        # Several jobs may probe one new folder at once (the replica groups of a fault-tolerant
        # run): another's clean-up can remove the folder between this one's mkdir and its write.
        for attempt in range(_PROBE_TRIES):
            try:
                root.mkdir(parents=True, exist_ok=True)
                probe.write_text("ok")
                probe.unlink()
                break
            except (FileNotFoundError, FileExistsError):  # made, or removed, by the other one
                if attempt == _PROBE_TRIES - 1:
                    raise self._not_writable(root, "it kept disappearing") from None
            except OSError as error:
                raise self._not_writable(root, error.strerror or str(error)) from None
        remove_if_empty(created)  # a folder another job's probe still uses stays

    @staticmethod
    def _not_writable(root: Path, why: str) -> KilnError:
        return KilnError(
            f"checkpoint directory {root} is not writable ({why}); set checkpoint.dir to a "
            "writable folder"
        )

    def writer(self, path: Location) -> StorageWriter:
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(Path(path))

    def reader(self, path: Location) -> StorageReader:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(Path(path))


_PROBE_TRIES = 5


def missing_folders(root: Location) -> list[Path]:
    """The folders writing under `root` would create, deepest first (none in an object store):
    what a start-up check removes again, so a run that fails at start-up leaves nothing."""
    if isinstance(root, ObjectPath):
        return []
    return [path for path in (Path(root), *Path(root).parents) if not path.exists()]


def remove_if_empty(folders: list[Path]) -> None:
    """Remove `folders` (deepest first) while they are empty."""
    for path in folders:
        try:
            path.rmdir()
        except OSError:
            break


def probe_name() -> str:
    """The write probe's name: one per process, as several jobs may probe one folder at once
    (the replica groups of a fault-tolerant run start together)."""
    return f".write_test_{socket.gethostname()}_{os.getpid()}"


def sync_path(path: Path) -> None:
    """fsync a file, or a folder (its entries: names created, renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        # Some network filesystems refuse fsync on a folder; their renames are synchronous.
        if not (Path(path).is_dir() and error.errno in (errno.EINVAL, errno.ENOTSUP)):
            raise
    finally:
        os.close(fd)


def _replace_synced(path: Path, text: str | bytes) -> None:
    """Replace `path` by a synced file holding `text`: readers see the old or the new, whole."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"  # two processes may replace one file
    with open(tmp, "wb" if isinstance(text, bytes) else "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)


_LOCAL = LocalStore()
_OBJECT_STORES: dict[str, CheckpointStore] = {}


def store_for(path: Location) -> CheckpointStore:
    """The store that holds `path`: the filesystem, or the object store of its URL's protocol."""
    if not isinstance(path, ObjectPath):
        return _LOCAL
    from kiln.checkpoint.object_store import FsspecStore
    from kiln.remote import protocol

    name = protocol(path.url)
    if name not in _OBJECT_STORES:
        _OBJECT_STORES[name] = FsspecStore(path.url)
    return _OBJECT_STORES[name]
