"""Locations that are URLs: `http(s)://`, `s3://`, `gs://` and any other fsspec protocol, opened
through fsspec with one clear message for each way reaching them fails."""

from __future__ import annotations

import re
from typing import Any

from kiln.errors import KilnError

# "s3://bucket/key", "https://host/file": a scheme of two or more letters (one letter is a
# Windows drive).
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+)://")

# The package fsspec needs for each object-store protocol, for the message when it is missing.
_PACKAGES = {"s3": "s3fs (pip install 'kiln[remote]')", "gs": "gcsfs", "gcs": "gcsfs"}


def is_url(location: str | object) -> bool:
    """Whether `location` names something fsspec opens by protocol rather than a local path."""
    match = _URL.match(str(location))
    return match is not None and match.group(1).lower() != "file"


def protocol(location: str) -> str:
    """The URL's protocol in lower case ("s3", "https"); "file" for a local path."""
    match = _URL.match(location)
    return match.group(1).lower() if match else "file"


def join(url: str, *names: str) -> str:
    """`url` with `names` appended as path parts ("s3://b/x/" + "val" -> "s3://b/x/val"); unlike
    Path, keeps the "//" after the scheme."""
    return "/".join([url.rstrip("/"), *(name.strip("/") for name in names)])


def filesystem(location: str) -> Any:
    """The fsspec filesystem serving `location`; a missing backend package is a KilnError."""
    import fsspec

    name = protocol(location)
    try:
        return fsspec.filesystem(name)
    except (ImportError, ValueError) as e:
        package = _PACKAGES.get(name)
        hint = f": install {package}" if package else ""
        raise KilnError(
            f"cannot open {location}: no filesystem for {name}://{hint} ({e})"
        ) from None


def reach_error(location: str, error: BaseException) -> KilnError:
    """One message for a URL that could not be reached or read: missing credentials, an
    unreachable host or bucket, or a missing object, saying which and what to check."""
    # fsspec's HTTP filesystem reports every failure as FileNotFoundError, from the real one.
    while isinstance(error, FileNotFoundError) and error.__cause__ is not None:
        error = error.__cause__
    text = f"{type(error).__name__}: {error}".strip()
    lowered = text.lower()
    if "credential" in lowered or "accessdenied" in lowered or "forbidden" in lowered:
        what = (
            "no valid credentials for it: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a "
            "profile), or GOOGLE_APPLICATION_CREDENTIALS for gs://"
        )
    elif isinstance(error, FileNotFoundError) or "nosuchbucket" in lowered or "404" in lowered:
        what = "it does not exist: check the bucket, the path and the spelling"
    else:
        what = (
            "it could not be reached: check the host or endpoint (AWS_ENDPOINT_URL for an "
            "S3-compatible store) and the network"
        )
    return KilnError(f"cannot read {location}: {what} ({first_line_of(text)})")


def first_line_of(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0][:300] if lines else ""


# Fields stores report that change when an object's content does, as fsspec names them: S3's
# ETag / LastModified / VersionId, GCS's md5Hash / crc32c / generation / updated, HTTP's ETag,
# Last-Modified, Content-MD5 and Digest headers.
_CHANGE_FIELDS = (
    "ETag",
    "etag",
    "LastModified",
    "last_modified",
    "VersionId",
    "md5Hash",
    "crc32c",
    "generation",
    "updated",
    "mtime",
    "Last-Modified",
    "Content-MD5",
    "Digest",
)


def change_fields(info: dict[str, Any]) -> dict[str, str]:
    """What of an fsspec `info()` result changes with the object's content (size aside), as
    strings (dates included) so that it can be stored in JSON and compared."""
    return {key: str(info[key]) for key in _CHANGE_FIELDS if info.get(key) not in (None, "")}


# A stream of bytes read and dropped to reach an offset on a server without range requests.
_SKIP_CHUNK = 2**22


def open_at(location: str, offset: int) -> Any:
    """`location` opened for reading bytes, positioned at `offset`. Object stores seek; an HTTP
    server that ignores range requests is read from the start and `offset` bytes dropped."""
    fs = filesystem(location)
    web = protocol(location) in ("http", "https")
    # From the start, HTTP streams: one request, whether or not the server reads ranges (a
    # range-less one passes a probe at byte 0 and fails at the second block).
    file = None if web and offset == 0 else _ranged(fs, location, offset)
    if file is not None:
        return file
    stream = fs.open(location, "rb", block_size=0)
    while offset > 0:
        dropped = stream.read(min(offset, _SKIP_CHUNK))
        if not dropped:
            break
        offset -= len(dropped)
    return stream


def open_seekable(location: str) -> Any:
    """`location` opened for random access (Parquet reads its footer first); from an HTTP
    server without range requests, the whole file, read into memory."""
    import io

    fs = filesystem(location)
    # Probe at the end: a file smaller than one block would pass a probe at the start.
    file = _ranged(fs, location, max(fs.size(location) - 1, 0))
    if file is not None:
        file.seek(0)
        return file
    return io.BytesIO(fs.cat_file(location))


def _ranged(fs: Any, location: str, offset: int) -> Any:
    """The file opened and positioned at `offset` if its server reads ranges, else None."""
    file = fs.open(location, "rb")
    try:
        file.seek(offset)
        file.read(1)  # an HTTP server without range support fails here, not at open
        file.seek(offset)
        return file
    except ValueError:
        file.close()
        return None
