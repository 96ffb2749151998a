"""Checkpoints in an object store (`s3://`, `gs://`, any fsspec protocol).

An object store has no folder rename: a save is written in place under its step prefix, and the
`COMPLETE` marker object, written last, is its commit; `latest` follows it. A step prefix without
a marker is an interrupted save, skipped on resume and deleted by the next save like a partial
folder on a filesystem. Each object appears whole when its upload returns, so no fsync exists or
is needed. Deleting a checkpoint deletes its marker first, so a half-deleted one never looks
complete.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kiln.checkpoint.store import MARKER, Location, StoreError, probe_name
from kiln.errors import KilnError
from kiln.remote import filesystem, protocol, reach_error

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageReader, StorageWriter

_Result = TypeVar("_Result")


def _reaching(action: str) -> Callable[[Callable[..., _Result]], Callable[..., _Result]]:
    """Turn a failure to reach the store (no credentials, no endpoint) into a StoreError that
    says so; OSErrors (a missing object is FileNotFoundError) pass as they are."""

    def wrap(method: Callable[..., _Result]) -> Callable[..., _Result]:
        @functools.wraps(method)
        def call(self: FsspecStore, path: Location, *args: Any) -> _Result:
            try:
                return method(self, path, *args)
            except OSError:
                raise
            except Exception as error:
                raise StoreError(store_message(action, str(path), error)) from error

        return call

    return wrap


def store_message(action: str, url: str, error: BaseException) -> str:
    """kiln.remote's message for a URL it could not reach, for `action` ("write to", "list")."""
    text = str(reach_error(url, error))
    return f"cannot {action} {url}: {text.removeprefix(f'cannot read {url}: ')}"


class FsspecStore:
    """An object store reached through fsspec: the marker object, written last, commits a save."""

    def __init__(self, url: str):
        import fsspec

        filesystem(url)  # a KilnError naming the package to install when fsspec has no backend
        # No listings cache: other ranks' processes write under the same prefixes, and a cached
        # listing would hide their objects from this one.
        self.options = {"use_listings_cache": False}
        # An instance of its own: credentials and endpoint are read from the environment now.
        self.fs = fsspec.filesystem(protocol(url), skip_instance_cache=True, **self.options)

    def staging(self, root: Location, step: int) -> Location:
        return root / f"step_{step:08d}"

    def partials(self, root: Location) -> list[Location]:
        return [
            child
            for child in self.children(root)
            if child.name.startswith("step_") and not self.is_file(child / MARKER)
        ]

    def publish(self, root: Location, step: int, marker: str, latest: str) -> Location:
        staged = self.staging(root, step)
        self.write_bytes(staged / MARKER, marker.encode())  # the commit: after every other object
        self.write_bytes(root / "latest", latest.encode())
        return staged

    @_reaching("read")
    def exists(self, path: Location) -> bool:
        return self.fs.exists(str(path))

    @_reaching("read")
    def is_file(self, path: Location) -> bool:
        return self.fs.isfile(str(path))

    @_reaching("list")
    def children(self, path: Location) -> list[Location]:
        try:
            names = self.fs.ls(str(path), detail=False)
        except FileNotFoundError:
            return []
        return sorted(path / name.rstrip("/").rsplit("/", 1)[-1] for name in names)

    @_reaching("list")
    def files(self, path: Location) -> dict[str, int]:
        prefix = self.fs._strip_protocol(str(path)).rstrip("/") + "/"
        try:
            found = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return {}
        return {
            name[len(prefix) :]: int(info["size"])
            for name, info in sorted(found.items())
            if name.startswith(prefix) and info.get("type", "file") == "file"
        }

    @_reaching("read")
    def read_bytes(self, path: Location) -> bytes:
        return self.fs.cat_file(str(path))

    @_reaching("write to")
    def write_bytes(self, path: Location, data: bytes) -> None:
        self.fs.pipe_file(str(path), data)

    def write_own(self, path: Location, data: bytes) -> None:
        self.write_bytes(path, data)  # an object is durable once its upload returns

    @_reaching("delete")
    def remove(self, path: Location) -> None:
        names = [str(path / name) for name in self.files(path)]
        marker = str(path / MARKER)
        if marker in names:  # first: a half-deleted checkpoint must never look complete
            self.fs.rm_file(marker)
            names.remove(marker)
        if names:
            self.fs.rm(names)

    @_reaching("delete")
    def remove_file(self, path: Location) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(str(path))

    def check_writable(self, root: Location) -> None:
        probe = root / probe_name()
        try:
            self.fs.pipe_file(str(probe), b"ok")
            self.fs.rm_file(str(probe))
        except Exception as error:
            raise KilnError(
                f"checkpoint.dir: {store_message('write to', str(root), error)}"
            ) from None

    def writer(self, path: Location) -> StorageWriter:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # sync_files: an upload is durable when it returns; DCP's fallback for a stream without
        # a file descriptor would be os.sync() of the whole machine after every file.
        return FsspecWriter(str(path), sync_files=False, **self.options)

    def reader(self, path: Location) -> StorageReader:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(str(path), **self.options)
