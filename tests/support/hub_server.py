"""A Hugging Face Hub on the loopback interface: serves dataset repositories from a local folder
(`root/<namespace>/<name>/<files>`) through the endpoints `datasets` and `huggingface_hub` use to
find and download a dataset. Point HF_ENDPOINT at it before they are imported."""

from __future__ import annotations

import hashlib
import http.server
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlparse

from tests.support.servers import serving

# Every repository is at this one revision.
REVISION = "0123456789abcdef0123456789abcdef01234567"


@contextmanager
def hub_server(root: Path) -> Iterator[str]:
    """Serve the dataset repositories under `root`; yields the endpoint URL for HF_ENDPOINT."""
    with serving(type("HubHandler", (_HubHandler,), {"root": root})) as url:
        yield url


class _HubHandler(http.server.BaseHTTPRequestHandler):
    root: Path

    def do_GET(self) -> None:
        self._answer(head=False)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def log_message(self, *args) -> None:
        pass

    def _answer(self, *, head: bool) -> None:
        parts = unquote(urlparse(self.path).path).strip("/").split("/")
        if parts[:2] == ["api", "datasets"]:
            self._api("/".join(parts[2:4]), parts[4:], head=head)
        elif parts[:1] == ["datasets"] and "resolve" in parts:
            at = parts.index("resolve")
            self._file("/".join(parts[1:at]), "/".join(parts[at + 2 :]), head=head)
        else:
            self._send(404, b"", {}, head=head)

    def _files(self, repo: str) -> list[Path] | None:
        folder = self.root / repo
        return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else None

    def _api(self, repo: str, rest: list[str], *, head: bool) -> None:
        """Repository info (`/api/datasets/R[/revision/X]`) and listings (`.../tree/X/path`)."""
        files = self._files(repo)
        if files is None:
            return self._missing(head=head)
        names = [str(p.relative_to(self.root / repo)) for p in files]
        if rest[:1] == ["tree"]:
            folder = "/".join(rest[2:])
            body = [
                {"type": "file", "path": name, "size": p.stat().st_size, "oid": _sha1(p)}
                for name, p in zip(names, files, strict=True)
                if not folder or name.startswith(folder + "/")
            ]
        else:
            body = {
                "id": repo,
                "sha": REVISION,
                "siblings": [{"rfilename": name} for name in names],
                "private": False,
                "gated": False,
                "disabled": False,
            }
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head=head)

    def _file(self, repo: str, name: str, *, head: bool) -> None:
        files = self._files(repo)
        if files is None:
            return self._missing(head=head)
        path = self.root / repo / name
        if not path.is_file():
            return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head=head)
        headers = {"X-Repo-Commit": REVISION, "ETag": f'"{_sha1(path)}"'}
        self._send(200, path.read_bytes(), headers, head=head)

    def _missing(self, *, head: bool) -> None:
        headers = {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}
        self._send(404, b'{"error": "Repository not found"}', headers, head=head)

    def _send(self, code: int, body: bytes, headers: dict[str, str], *, head: bool) -> None:
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)


def _sha1(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()
