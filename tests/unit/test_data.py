"""Data subsystem: tokenizer, shard format, memory-mapped dataset, prepare, demo corpus."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from kiln.data import (
    EOS_TOKEN,
    DatasetExistsError,
    ShardWriter,
    TokenDataset,
    demo_corpus,
    ensure_demo_corpus,
    eos_id,
    load_tokenizer,
    prepare_dataset,
    read_index,
    tokenizer_hash,
    train_bpe_tokenizer,
)
from kiln.errors import KilnError

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n\tdef __init__(self, x):\n\t\tself.x = x  # trailing  spaces  \n\n",
    "Grüße, 世界! Ünïcödé and emoji 🚀\r\nwindows line end\n",
    "for i in range(10):\n        print(i * i)\n",
] * 20


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(TEXTS, vocab_size=512).save(str(path))
    return path


def write_documents(output: Path, tokenizer_file: Path, docs: list[list[int]], **kwargs) -> Path:
    with ShardWriter(output, tokenizer_file, **kwargs) as writer:
        for doc in docs:
            writer.add_document(doc)
    return output


def random_documents(seed: int, count: int, vocab: int = 259) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Ids below 259 exist in any byte-level vocab; 0-2 are the special tokens (1 = eos), kept out
    # of the bodies so document boundaries are unambiguous.
    return [rng.integers(3, vocab, size=int(rng.integers(0, 40))).tolist() for _ in range(count)]


def stream_of(docs: list[list[int]], eos: int) -> np.ndarray:
    return np.array([t for doc in docs for t in [*doc, eos]], dtype=np.int64)


# --- tokenizer ---------------------------------------------------------------------------


def test_tokenizer_round_trips_text_exactly(tokenizer_file: Path) -> None:
    tok = load_tokenizer(tokenizer_file)
    unseen = "if x:\n\n    y = '''\n\ttabs\tand   spaces   '''\r\n# Ω≈ç√ 🐍\n"
    for text in [*TEXTS[:4], unseen]:
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    assert tok.get_vocab_size() <= 512
    assert tok.id_to_token(eos_id(tok)) == EOS_TOKEN


def test_tokenizer_hash_is_sha256_of_file(tokenizer_file: Path) -> None:
    assert tokenizer_hash(tokenizer_file) == hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(KilnError, match="not found"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(KilnError, match="not a valid tokenizer"):
        load_tokenizer(bad)


def test_too_small_vocab_is_rejected() -> None:
    with pytest.raises(KilnError, match="too small"):
        train_bpe_tokenizer(TEXTS, vocab_size=100)


# --- shards + dataset --------------------------------------------------------------------


def test_samples_span_shard_boundaries(tmp_path: Path, tokenizer_file: Path) -> None:
    docs = random_documents(seed=0, count=50)
    out = write_documents(tmp_path / "ds", tokenizer_file, docs, shard_tokens=37)
    index = read_index(out)
    assert len(index["shards"]) > 5
    assert index["dtype"] == "uint16"
    assert index["tokenizer_sha256"] == tokenizer_hash(tokenizer_file)
    assert (out / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()

    ds = TokenDataset(out, seq_len=16)
    stream = stream_of(docs, ds.eos_id)
    assert ds.num_tokens == len(stream) == index["num_tokens"]
    assert len(ds) == (len(stream) - 1) // 16
    for i in range(len(ds)):
        sample = ds.sample(i)
        assert sample.dtype == np.int64
        np.testing.assert_array_equal(sample, stream[i * 16 : i * 16 + 17])
    # A window longer than any shard crosses several of them.
    np.testing.assert_array_equal(TokenDataset(out, seq_len=100).sample(1), stream[100:201])
    with pytest.raises(IndexError):
        ds.sample(len(ds))


def test_document_boundaries_are_recorded(tmp_path: Path, tokenizer_file: Path) -> None:
    docs = random_documents(seed=1, count=30)
    out = write_documents(tmp_path / "ds", tokenizer_file, docs, shard_tokens=50)
    ds = TokenDataset(out, seq_len=8)
    lengths = [len(doc) + 1 for doc in docs]
    expected_starts = np.cumsum([0, *lengths[:-1]])
    np.testing.assert_array_equal(ds.document_starts(), expected_starts)
    stream = stream_of(docs, ds.eos_id)
    np.testing.assert_array_equal(np.flatnonzero(stream == ds.eos_id), np.cumsum(lengths) - 1)
    index = read_index(out)
    assert sum(s["num_documents"] for s in index["shards"]) == index["num_documents"] == 30
    for shard in index["shards"]:
        starts = np.load(out / shard["docs_file"])
        assert starts.dtype == np.uint64 and starts[0] == 0


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failed_write_leaves_nothing_behind(
    tmp_path: Path, tokenizer_file: Path, error: type[BaseException]
) -> None:
    with pytest.raises(error), ShardWriter(tmp_path / "ds", tokenizer_file, shard_tokens=2) as w:
        for _ in range(5):
            w.add_document([5, 6, 7])
        raise error("interrupted mid-write")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_overwrite(tmp_path: Path, tokenizer_file: Path) -> None:
    out = write_documents(tmp_path / "ds", tokenizer_file, [[5, 6]])
    with pytest.raises(KilnError, match="overwrite"):
        ShardWriter(out, tokenizer_file)
    write_documents(out, tokenizer_file, [[7, 8, 9]], overwrite=True)
    assert TokenDataset(out, seq_len=2).sample(0).tolist() == [7, 8, 9]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    # overwrite must never delete a directory that is not a dataset.
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("precious")
    with pytest.raises(KilnError, match="not a kiln dataset"):
        ShardWriter(other, tokenizer_file, overwrite=True)


def test_concurrent_writers_first_to_finish_wins(tmp_path: Path, tokenizer_file: Path) -> None:
    out = tmp_path / "ds"
    with pytest.raises(DatasetExistsError), ShardWriter(out, tokenizer_file) as slow:
        slow.add_document([5])
        write_documents(out, tokenizer_file, [[6, 7]])
    assert TokenDataset(out, seq_len=2).sample(0).tolist() == [6, 7, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_out_of_range_token_is_rejected(tmp_path: Path, tokenizer_file: Path) -> None:
    with pytest.raises(KilnError, match="out of range"):
        write_documents(tmp_path / "ds", tokenizer_file, [[5, 10_000]])
    assert not (tmp_path / "ds").exists()


def test_a_text_file_as_dataset_says_how_to_prepare_it(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("some text")
    with pytest.raises(KilnError) as error:
        TokenDataset(notes, seq_len=8)
    message = str(error.value)
    assert "is a file" in message and "not found" not in message
    assert f"kiln prepare --input {notes} --tokenizer tokenizer.json --output data/notes" in message
    assert "data.path=data/notes" in message


def test_dataset_errors(tmp_path: Path, tokenizer_file: Path) -> None:
    with pytest.raises(KilnError, match="not found"):
        TokenDataset(tmp_path / "missing", seq_len=8)
    (tmp_path / "plain").mkdir()
    with pytest.raises(KilnError, match="not a kiln dataset"):
        TokenDataset(tmp_path / "plain", seq_len=8)
    out = write_documents(tmp_path / "ds", tokenizer_file, [[5, 6, 7]])
    with pytest.raises(KilnError, match="too few"):
        TokenDataset(out, seq_len=4)
    assert len(TokenDataset(out, seq_len=3)) == 1
    (out / "shard_00000.bin").write_bytes(b"\x00\x00")
    with pytest.raises(KilnError, match=r"shard_00000\.bin"):
        TokenDataset(out, seq_len=1)
    (out / "index.json").write_text("{truncated")
    with pytest.raises(KilnError, match="corrupt"):
        TokenDataset(out, seq_len=1)


def test_dataset_pickles_without_token_data(tmp_path: Path, tokenizer_file: Path) -> None:
    docs = random_documents(seed=2, count=200)
    ds = TokenDataset(write_documents(tmp_path / "ds", tokenizer_file, docs), seq_len=8)
    first = ds.sample(3)
    copy = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 4096
    np.testing.assert_array_equal(copy.sample(3), first)


# --- prepare -----------------------------------------------------------------------------


def make_inputs(root: Path) -> list[str]:
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(TEXTS[0])
    (root / "sub" / "b.txt").write_text(TEXTS[1])
    (root / "sub" / "ignored.csv").write_text("x,y\n")
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS[2:4])]
    (root / "c.jsonl").write_text("\n".join(lines) + "\n\n")
    return [TEXTS[0], TEXTS[2], TEXTS[3], TEXTS[1]]  # sorted file order: a.txt, c.jsonl, sub/b.txt


@pytest.mark.parametrize("num_workers", [0, 2])
def test_prepare_txt_and_jsonl(tmp_path: Path, tokenizer_file: Path, num_workers: int) -> None:
    expected_texts = make_inputs(tmp_path / "in")
    out = prepare_dataset(
        [tmp_path / "in"], tokenizer_file, tmp_path / "out", num_workers=num_workers
    )
    ds = TokenDataset(out, seq_len=4)
    tok = load_tokenizer(ds.tokenizer_path)
    tokens = ds.read(0, ds.num_tokens)
    docs = np.split(tokens, np.flatnonzero(tokens == ds.eos_id) + 1)[:-1]
    assert [tok.decode(doc[:-1].tolist()) for doc in docs] == expected_texts


def test_prepare_errors(
    tmp_path: Path, tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(KilnError, match="no input files"):
        prepare_dataset([tmp_path / "empty"], tokenizer_file, tmp_path / "out", num_workers=0)
    with pytest.raises(KilnError, match="input not found"):
        prepare_dataset([tmp_path / "nope"], tokenizer_file, tmp_path / "out", num_workers=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "x"}\n')
    with pytest.raises(KilnError, match="text_key"):
        prepare_dataset([bad], tokenizer_file, tmp_path / "out", num_workers=0)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(KilnError, match="cannot read"):
        prepare_dataset([binary], tokenizer_file, tmp_path / "out", num_workers=0)
    parquet = tmp_path / "data.parquet"
    parquet.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail
    with pytest.raises(KilnError, match="pip install pyarrow"):
        prepare_dataset([parquet], tokenizer_file, tmp_path / "out", num_workers=0)
    assert not (tmp_path / "out").exists()


# --- demo corpus -------------------------------------------------------------------------


def test_demo_corpus_builds_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = ensure_demo_corpus(tmp_path / "demo", vocab_size=512, max_bytes=300_000)
    assert "building the demo corpus" in capsys.readouterr().err
    ds = TokenDataset(path, seq_len=64)
    assert ds.vocab_size == 512
    assert ds.num_tokens > 50_000
    text = load_tokenizer(ds.tokenizer_path).decode(ds.sample(10).tolist())
    assert text.strip()
    before = (path / "index.json").stat().st_mtime_ns
    assert ensure_demo_corpus(tmp_path / "demo", vocab_size=512, max_bytes=300_000) == path
    assert (path / "index.json").stat().st_mtime_ns == before
    assert capsys.readouterr().err == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


def test_demo_corpus_race_keeps_the_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    winner = ensure_demo_corpus(tmp_path / "a", vocab_size=512, max_bytes=100_000)
    original = demo_corpus.train_bpe_tokenizer

    def train_then_lose(texts: list[str], vocab_size: int) -> Tokenizer:
        # Another process publishes the corpus while this one is still building it.
        shutil.copytree(winner, tmp_path / "b")
        return original(texts, vocab_size)

    monkeypatch.setattr(demo_corpus, "train_bpe_tokenizer", train_then_lose)
    result = ensure_demo_corpus(tmp_path / "b", vocab_size=512, max_bytes=100_000)
    assert read_index(result) == read_index(winner)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
