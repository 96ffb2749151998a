"""`kiln prepare --input URL`: HTTP and S3 inputs (a file, a prefix, a glob) give the tokens of
their local copies; a changed object is noticed on re-run; an unreachable server, a missing
object or bucket is one message, with nothing written. Real servers on loopback, no mocks."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.data import TokenDataset, prepare_dataset, read_index
from kiln.data import units as units_module
from kiln.data.tokenizer import train_bpe_tokenizer
from kiln.errors import KilnError
from kiln.remote import open_at
from tests.support.servers import http_server, make_bucket

TEXTS = [f"row {i}: print({i} * 'ab')  # é {i % 5}\n" for i in range(90)]
FILES = ("a.jsonl", "b.parquet", "c.txt")


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(TEXTS[:20], vocab_size=300).save(str(path))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    lines = [json.dumps({"text": text}) for text in TEXTS[:50]]
    (root / "a.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"text": TEXTS[50:89]}), root / "b.parquet", row_group_size=10)
    (root / "c.txt").write_text("line one\r\nline two\n" + TEXTS[89])
    return root


def tokens(path: Path) -> tuple[list[int], list[int]]:
    dataset = TokenDataset(path, seq_len=1)
    starts = dataset.document_starts().tolist()
    return dataset.read(0, dataset.num_tokens).tolist(), starts


def prepare(inputs: list[str], tokenizer: Path, output: Path, **options) -> Path:
    return prepare_dataset(inputs, tokenizer, output, num_workers=0, **options)


def test_http_inputs_give_the_local_tokens(
    tmp_path: Path, corpus: Path, tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = [str(corpus / name) for name in FILES]
    local = prepare(files, tokenizer_file, tmp_path / "local", val_fraction=0.3)
    with http_server(corpus) as base:
        urls = [f"{base}/{name}" for name in FILES]
        remote = prepare(urls, tokenizer_file, tmp_path / "remote", val_fraction=0.3)
        source = read_index(remote)["sources"][0]
        assert source["url"] == urls[0] and source["bytes"] == (corpus / FILES[0]).stat().st_size
        assert "Last-Modified" in source  # the server's validator, to notice a change
        # Cut into byte ranges, so parts seek: this server ignores ranges and is read through.
        monkeypatch.setattr(units_module, "UNIT_BYTES", 300)
        for part in range(3):
            prepare(urls, tokenizer_file, tmp_path / "parts", part=part, parts=3, val_fraction=0.3)
    for split in ("", "val"):
        expected = tokens(local / split)
        assert tokens(remote / split) == expected and tokens(tmp_path / "parts" / split) == expected


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/a.jsonl"


def test_unreachable_or_missing_http_inputs(
    tmp_path: Path, corpus: Path, tokenizer_file: Path
) -> None:
    out = tmp_path / "out"
    with pytest.raises(
        KilnError, match=r"cannot read http://127\.0\.0\.1:\d+/a\.jsonl: it could not be reached"
    ):
        prepare([closed_port_url()], tokenizer_file, out)
    with http_server(corpus) as base:
        with pytest.raises(KilnError, match=r"nope\.jsonl: it does not exist"):
            prepare([f"{base}/nope.jsonl"], tokenizer_file, out)
        with pytest.raises(KilnError, match=r"unsupported input .*notes\.csv"):
            prepare([f"{base}/notes.csv"], tokenizer_file, out)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


def upload(endpoint: str, bucket: str, corpus: Path) -> None:
    make_bucket(endpoint, bucket)
    client = boto3.client("s3", endpoint_url=endpoint)
    for name in FILES:
        client.upload_file(str(corpus / name), bucket, f"corpus/{name}")
    client.put_object(Bucket=bucket, Key="corpus/README.md", Body=b"not an input")


def test_s3_file_prefix_and_glob_give_the_local_tokens(
    tmp_path: Path, corpus: Path, tokenizer_file: Path, s3_env: dict, s3_endpoint: str
) -> None:
    upload(s3_endpoint, "inputs", corpus)
    local = prepare([str(corpus / name) for name in FILES], tokenizer_file, tmp_path / "local")
    remote = {
        "files": [f"s3://inputs/corpus/{name}" for name in FILES],
        "prefix": ["s3://inputs/corpus"],
        "glob": [
            "s3://inputs/corpus/*.jsonl",
            "s3://inputs/corpus/*.parquet",
            "s3://inputs/corpus/c.*",
        ],
    }
    for name, inputs in remote.items():
        out = prepare(inputs, tokenizer_file, tmp_path / name)
        assert tokens(out) == tokens(local), name
        assert [s["url"] for s in read_index(out)["sources"]] == remote["files"]
        assert all(s["ETag"] for s in read_index(out)["sources"])
    # Parts read byte ranges and row groups of the objects.
    for part in range(2):
        prepare(remote["prefix"], tokenizer_file, tmp_path / "parts", part=part, parts=2)
    assert tokens(tmp_path / "parts") == tokens(local)
    # A replaced object is noticed: same inputs, other content.
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(
        Bucket="inputs", Key="corpus/c.txt", Body=b"changed"
    )
    with pytest.raises(KilnError, match=r"holds a different dataset \(other inputs\)"):
        prepare(remote["prefix"], tokenizer_file, tmp_path / "prefix")


def test_missing_s3_object_or_bucket(
    tmp_path: Path, tokenizer_file: Path, s3_env: dict, s3_endpoint: str
) -> None:
    make_bucket(s3_endpoint, "empty")
    out = tmp_path / "out"
    cases = {
        "s3://empty/nope.jsonl": "it does not exist",
        "s3://no-such-bucket/a.jsonl": "it does not exist",
        "s3://empty/corpus/*.jsonl": "it does not exist",
    }
    for url, message in cases.items():
        with pytest.raises(KilnError, match=rf"cannot read {url.replace('*', '.')}: {message}"):
            prepare([url], tokenizer_file, out)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


def test_open_at_any_offset_of_a_server_without_ranges(tmp_path: Path) -> None:
    """Python's HTTP server ignores range requests: a file larger than fsspec's 5 MB block is
    streamed from the start, wherever the reader starts."""
    data = bytes(range(256)) * (6 * 2**20 // 256)
    (tmp_path / "big.jsonl").write_bytes(data)
    with http_server(tmp_path) as base:
        for offset in (0, 1, 5 * 2**20 + 3):
            with open_at(f"{base}/big.jsonl", offset) as file:
                assert file.read() == data[offset:]
