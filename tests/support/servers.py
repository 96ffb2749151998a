"""Servers on the loopback interface for the remote-data and object-store tests: a static HTTP
server over a folder, and moto's S3-compatible server. Nothing here reaches the internet."""

from __future__ import annotations

import functools
import http.server
import logging
import os
import threading
from collections.abc import Iterator
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


@contextmanager
def http_server(root: Path) -> Iterator[str]:
    """Serve `root` read-only over HTTP on 127.0.0.1; yields the base URL (no trailing slash)."""

    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
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
