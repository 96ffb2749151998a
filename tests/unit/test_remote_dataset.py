"""Prepared datasets read from a URL: loopback HTTP and S3 (moto) servers, never mocks. Samples
and batches equal the local copy's bitwise; a changed shard, a missing bucket and a closed port
each fail at open with one message."""

from __future__ import annotations

import hashlib
import pickle
import socket
from pathlib import Path

import numpy as np
import pytest

from kiln.config.sections import DataConfig
from kiln.data import ShardWriter, TokenDataset, train_bpe_tokenizer
from kiln.data.loader import BatchLoader, ShuffledSamples, Source
from kiln.data.sources import open_eval_data
from kiln.errors import KilnError
from kiln.train.eval_checkpoint import _own_held_out_data
from tests.support.servers import http_server, make_bucket

SEQ = 16
BUCKET = "kiln-remote-data"


@pytest.fixture(scope="module")
def local_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding `ds`: a prepared dataset of several shards, with a `val/` split."""
    root = tmp_path_factory.mktemp("remote")
    tokenizer = root / "tokenizer.json"
    train_bpe_tokenizer(["a few words of text"] * 4, vocab_size=300).save(str(tokenizer))
    write_dataset(root / "ds", tokenizer, documents=48)
    write_dataset(root / "ds" / "val", tokenizer, documents=16)
    return root


def write_dataset(path: Path, tokenizer: Path, *, documents: int) -> None:
    rng = np.random.default_rng(documents)
    with ShardWriter(path, tokenizer, shard_tokens=64) as writer:
        for _ in range(documents):
            writer.add_document(rng.integers(3, 259, size=int(rng.integers(1, 12))).tolist())


@pytest.fixture(autouse=True)
def tokenizer_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Remote tokenizers are copied under the user cache: this test's, not the real one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def s3_root(s3_env: dict[str, str], local_root: Path) -> str:
    """The prepared dataset (its files, not val/: read over HTTP) uploaded to the local S3
    server once; the bucket's URL."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    if not fs.exists(f"{BUCKET}/ds/index.json"):
        make_bucket(s3_env["AWS_ENDPOINT_URL"], BUCKET)
        files = [str(f) for f in sorted((local_root / "ds").iterdir()) if f.is_file()]
        fs.put(files, f"{BUCKET}/ds/")
    return f"s3://{BUCKET}"


def assert_same_dataset(remote: TokenDataset, local: TokenDataset) -> None:
    assert (len(remote), remote.vocab_size, remote.eos_id) == (len(local), local.vocab_size, 1)
    for i in range(len(local)):
        np.testing.assert_array_equal(remote.sample(i), local.sample(i))
    np.testing.assert_array_equal(remote.document_starts(), local.document_starts())
    digest = hashlib.sha256(local.tokenizer_path.read_bytes()).hexdigest()
    assert hashlib.sha256(remote.tokenizer_path.read_bytes()).hexdigest() == digest
    copy = pickle.loads(pickle.dumps(remote))  # as the loader's worker processes get it
    np.testing.assert_array_equal(copy.sample(len(local) - 1), local.sample(len(local) - 1))


def test_every_sample_read_over_http_and_s3_equals_the_local_one(
    local_root: Path, s3_root: str
) -> None:
    local = TokenDataset(local_root / "ds", SEQ)
    assert len(local._index["shards"]) > 3  # samples cross shard boundaries
    with http_server(local_root, ranges=True) as base:
        assert_same_dataset(TokenDataset(f"{base}/ds", SEQ), local)
        # eval's default: the val/ split beside data.path, joined without folding the "//".
        held_out = open_eval_data(
            "",
            DataConfig(path=f"{base}/ds"),
            seq_len=SEQ,
            model_vocab_size=300,
            tokenizer_path=None,
        )
        assert held_out.path == f"{base}/ds/val"
        assert _own_held_out_data({"data": {"path": f"{base}/ds"}}) == f"{base}/ds/val"  # kiln eval
        assert_same_dataset(held_out, TokenDataset(local_root / "ds" / "val", SEQ))
    with http_server(local_root) as base, pytest.raises(KilnError, match="ignores HTTP range"):
        TokenDataset(f"{base}/ds", SEQ).sample(0)  # never the whole shard in its place
    remote = TokenDataset(f"{s3_root}/ds/", SEQ)
    assert remote.path == f"{s3_root}/ds"
    assert_same_dataset(remote, local)


def test_loader_workers_over_s3_give_the_local_batches(local_root: Path, s3_root: str) -> None:
    cfg = DataConfig(document_mask=True)

    def batches(dataset: TokenDataset, workers: int) -> list:
        source = Source("data", ShuffledSamples(dataset, seed=3), dataset.eos_id)
        loader = BatchLoader(
            [source], cfg, seed=5, batch_size=2, grad_accum_steps=2, num_workers=workers
        )
        steps = [loader.next_step() for _ in range(4)]
        return [(x.numpy(), y.numpy()) for step in steps for x, y in step.micro_batches]

    local = batches(TokenDataset(local_root / "ds", SEQ), workers=0)
    remote = batches(TokenDataset(f"{s3_root}/ds", SEQ), workers=2)
    for (x, y), (rx, ry) in zip(local, remote, strict=True):
        np.testing.assert_array_equal(rx, x)
        np.testing.assert_array_equal(ry, y)


def test_a_remote_shard_that_changed_is_named_at_open(
    local_root: Path, s3_root: str, tmp_path: Path
) -> None:
    import s3fs

    write_dataset(tmp_path / "small", local_root / "tokenizer.json", documents=12)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.put([str(f) for f in sorted((tmp_path / "small").iterdir())], f"{BUCKET}/changed/")
    shard = (tmp_path / "small" / "shard_00001.bin").read_bytes()
    fs.pipe_file(f"{BUCKET}/changed/shard_00001.bin", shard[:-6])
    expected = (
        rf"shard shard_00001\.bin is {len(shard) - 6} bytes, but index\.json says {len(shard)} "
        rf"bytes \({len(shard) // 2} uint16 tokens\): it changed since the dataset was prepared; "
        "upload the whole folder"
    )
    with pytest.raises(KilnError, match=expected):
        TokenDataset(f"{s3_root}/changed", SEQ)
    fs.pipe_file(f"{BUCKET}/changed/shard_00001.bin", shard)
    fs.rm(f"{BUCKET}/changed/shard_00001.docs.npy")
    with pytest.raises(KilnError, match=r"shard_00001\.docs\.npy is missing"):
        TokenDataset(f"{s3_root}/changed", SEQ)
    fs.rm(f"{BUCKET}/changed/index.json")
    with pytest.raises(KilnError, match=r"changed is not a kiln dataset \(no index\.json\)"):
        TokenDataset(f"{s3_root}/changed", SEQ)


def test_a_missing_bucket_or_a_closed_port_is_one_message(s3_env: dict[str, str]) -> None:
    with pytest.raises(
        KilnError, match=r"cannot read s3://no-such-bucket/ds/index\.json: it does no"
    ):
        TokenDataset("s3://no-such-bucket/ds", SEQ)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(KilnError, match="could not be reached: check the host or endpoint"):
        TokenDataset(f"http://127.0.0.1:{port}/ds", SEQ)
