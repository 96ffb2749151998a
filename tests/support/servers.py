"""Servers on the loopback interface for the remote-data and object-store tests: a static HTTP
server over a folder, and moto's S3-compatible server. Nothing here reaches the internet."""

from __future__ import annotations

import functools
import http.server
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# Credentials and region for the local S3 server: botocore (under s3fs) reads these variables,
# as it would a real deployment's.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "kiln-test",
    "AWS_SECRET_ACCESS_KEY": "kiln-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


class _RangeHandler(_QuietHandler):
    """Also answers `Range: bytes=a-b` with 206 and just those bytes, as object stores and most
    web servers do (Python's own handler sends the whole file)."""

    _length: int | None = None

    def send_head(self):
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        path = self.translate_path(self.path)
        if match is None or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        first, last = int(match[1]), min(int(match[2] or size - 1), size - 1)
        if first >= size:
            self.send_error(416, "Requested Range Not Satisfiable")
            return None
        file = open(path, "rb")  # noqa: SIM115 - closed by the handler after copyfile
        file.seek(first)
        self._length = last - first + 1
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.send_header("Content-Length", str(self._length))
        self.end_headers()
        return file

    def copyfile(self, source, outputfile) -> None:
        if self._length is None:
            return super().copyfile(source, outputfile)
        outputfile.write(source.read(self._length))


@contextmanager
def http_server(root: Path, *, ranges: bool = False) -> Iterator[str]:
    """Serve `root` read-only over HTTP on 127.0.0.1; yields the base URL (no trailing slash).
    With `ranges`, byte-range requests get just their bytes; without, the whole file."""
    handler = functools.partial(_RangeHandler if ranges else _QuietHandler, directory=str(root))
    with serving(handler) as url:
        yield url


@contextmanager
def serving(handler: Callable[..., http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """An HTTP server for `handler` on 127.0.0.1, in a thread; yields its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    # A short poll: shutdown() waits up to one poll interval (0.5 s by default).
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def s3_server() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 (in a thread of this process); yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{server._server.server_port}"
    finally:
        server.stop()


def make_bucket(endpoint: str, name: str) -> None:
    """Create bucket `name` on the local S3 server."""
    import boto3

    boto3.client("s3", endpoint_url=endpoint, **_boto_credentials()).create_bucket(Bucket=name)


def _boto_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"],
        "region_name": S3_ENV["AWS_DEFAULT_REGION"],
    }


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """One local S3 server for the session."""
    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch) -> dict[str, str]:
    """This process (and the subprocesses it starts) pointed at the local S3 server, the way a
    user points kiln at an S3-compatible store: botocore's standard environment variables."""
    env = {**S3_ENV, "AWS_ENDPOINT_URL": s3_endpoint}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    return {**os.environ, **env}
