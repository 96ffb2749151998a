"""`hf:NAME` from the Hugging Face Hub, served on the loopback interface: `kiln prepare`
downloads the dataset when online, reads it from the cache with HF_HUB_OFFLINE=1, and says in
one message what is wrong when the dataset does not exist or the Hub cannot be reached."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.data import prepare_dataset, read_index
from kiln.data.dataset import TokenDataset
from kiln.data.tokenizer import train_bpe_tokenizer
from tests.support.hub_server import hub_server

TEXTS = [f"record {i}: the quick brown fox {'jumps ' * (i % 5)}over the dog\n" for i in range(30)]


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    """A Hub folder holding one dataset repository, kiln-test/tiny (one JSONL file)."""
    root = tmp_path_factory.mktemp("hub")
    (root / "kiln-test" / "tiny").mkdir(parents=True)
    lines = "".join(json.dumps({"text": text}) + "\n" for text in TEXTS)
    (root / "kiln-test" / "tiny" / "train.jsonl").write_text(lines)
    return root


def kiln_prepare(
    dataset: str, output: Path, tokenizer: Path, *, endpoint: str, home: Path, offline: bool
) -> subprocess.CompletedProcess:
    """`kiln prepare --input hf:<dataset>` in a process of its own: the Hub libraries read
    HF_ENDPOINT and HF_HUB_OFFLINE when they are imported."""
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_OFFLINE": "0"}
    env.pop("HF_DATASETS_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    command = [sys.executable, "-m", "kiln", "prepare", "--input", f"hf:{dataset}"]
    command += ["--tokenizer", str(tokenizer), "--output", str(output), "--num-workers", "0"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_hub_dataset_is_downloaded_online_and_read_from_the_cache_offline(hub, tmp_path):
    tokenizer = tmp_path / "tokenizer.json"
    train_bpe_tokenizer(TEXTS, vocab_size=300).save(str(tokenizer))
    (tmp_path / "local.jsonl").write_text((hub / "kiln-test" / "tiny" / "train.jsonl").read_text())
    local = prepare_dataset(
        [tmp_path / "local.jsonl"], tokenizer, tmp_path / "local", num_workers=0
    )
    expected = TokenDataset(local, seq_len=1).read(0, read_index(local)["num_tokens"])
    home = tmp_path / "hf_home"
    with hub_server(hub) as endpoint:
        online = kiln_prepare(
            "kiln-test/tiny",
            tmp_path / "online",
            tokenizer,
            endpoint=endpoint,
            home=home,
            offline=False,
        )
        assert online.returncode == 0, online.stderr
        absent = kiln_prepare(
            "kiln-test/absent",
            tmp_path / "absent",
            tokenizer,
            endpoint=endpoint,
            home=home,
            offline=False,
        )
    for name in ("online",):
        got = TokenDataset(tmp_path / name, seq_len=1)
        assert (got.read(0, got.num_tokens) == expected).all()  # the same bytes, tokenized alike
    assert absent.returncode == 2
    assert "there is no dataset 'kiln-test/absent' on the Hugging Face Hub" in absent.stderr
    assert not (tmp_path / "absent").exists()
    # The Hub is gone: offline, the download is read from the cache; online, one message.
    gone = closed_port()
    offline = kiln_prepare(
        "kiln-test/tiny", tmp_path / "offline", tokenizer, endpoint=gone, home=home, offline=True
    )
    assert offline.returncode == 0, offline.stderr
    got = TokenDataset(tmp_path / "offline", seq_len=1)
    assert (got.read(0, got.num_tokens) == expected).all()
    unreachable = kiln_prepare(
        "kiln-test/other", tmp_path / "other", tokenizer, endpoint=gone, home=home, offline=False
    )
    assert unreachable.returncode == 2
    assert "cannot reach the Hugging Face Hub" in unreachable.stderr, unreachable.stderr
    assert "HF_HUB_OFFLINE=1" in unreachable.stderr
