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
