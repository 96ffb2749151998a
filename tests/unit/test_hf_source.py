"""Hugging Face datasets read at train time: eager (tokenized once into the run's cache) and
streaming (tokenized while training, position saved). Real `datasets` folders, real tokenizer."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import datasets
import fsspec
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kiln.config import load_config
from kiln.config.sections import DataConfig, DatasetSource
from kiln.data import encode_ids, eos_id, load_tokenizer
from kiln.data.hf_source import StreamingSamples
from kiln.data.loader import BatchLoader
from kiln.data.sources import ensure_local_data, open_training_data
from kiln.errors import ConfigError, KilnError
from kiln.tokens import EOS_TOKEN, IGNORE_INDEX
from kiln.train.trainer import Trainer
from tests.conftest import DEBUG_CONFIG
from tests.support.servers import http_server, make_bucket

SEQ = 16


def texts() -> list[str]:
    """Documents from a few tokens to several windows long, and an empty row."""
    docs = [f"def f{i}(a, b):\n    return a * {i} + b\n" * (1 + i % 9) for i in range(120)]
    docs[7] = ""
    return docs


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "saved"
    datasets.Dataset.from_dict({"content": texts(), "id": list(range(120))}).save_to_disk(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(demo_data) -> Path:
    return demo_data / "tokenizer.json"


def token_stream(tokenizer: Path) -> np.ndarray:
    """What both modes read: every non-empty document's tokens, each followed by EOS."""
    tok = load_tokenizer(tokenizer)
    docs = [text for text in texts() if text]
    return np.concatenate([[*ids, eos_id(tok)] for ids in encode_ids(tok, docs)])


def entry(saved: Path, **kwargs) -> DatasetSource:
    return DatasetSource(name="code", source="hf", path=str(saved), text_key="content", **kwargs)


def document_tokens(tokenizer: Path) -> list[np.ndarray]:
    """Each row's tokens as streamed: the document and EOS, or nothing for an empty row."""
    tok = load_tokenizer(tokenizer)
    ids = encode_ids(tok, [text or "" for text in texts()])
    return [
        np.array([*i, eos_id(tok)] if text else [], dtype=np.int64)
        for text, i in zip(texts(), ids, strict=True)
    ]


def windows_of(documents: list[np.ndarray], count: int) -> list[np.ndarray]:
    stream = np.concatenate(documents)
    return [stream[k * SEQ : k * SEQ + SEQ + 1] for k in range(count)]


def streamer(saved: Path, tokenizer: Path, rank: int = 0, ranks: int = 1) -> StreamingSamples:
    return StreamingSamples(
        entry(saved, streaming=True),
        tokenizer_path=tokenizer,
        seq_len=SEQ,
        data_rank=rank,
        data_ranks=ranks,
    )


def gathered(streams: list[StreamingSamples]) -> dict:
    """What a checkpoint keeps: every rank's position (the loader gathers them across ranks)."""
    return streams[0].gathered_state([s.position() for s in streams])


def stream_loaders(
    cfg: DataConfig, ranks: int, *, batch_size: int, grad_accum_steps: int = 1
) -> list[BatchLoader]:
    """Data ranks 0 .. ranks - 1 of a streamed dataset in this one process, as the trainer makes
    them (one rank: no gather, as in one process)."""
    made = []

    def gather(value):
        if isinstance(value, tuple):  # a save: every rank's positions
            return [(lo.data_rank, lo._state["streams"]) for lo in made]
        return [value]  # a step's failure: only this rank's is known in one process

    for rank in range(ranks):
        (source,) = open_training_data(
            cfg,
            seq_len=SEQ,
            model_vocab_size=4096,
            seed=0,
            cache_dir=Path("unused"),
            data_rank=rank,
            data_ranks=ranks,
        )
        loader = BatchLoader(
            [source],
            cfg,
            seed=0,
            batch_size=batch_size,
            grad_accum_steps=grad_accum_steps,
            data_ranks=ranks,
            data_rank=rank,
            gather=gather if ranks > 1 else None,
        )
        made.append(loader)
    return made


@pytest.mark.parametrize("ranks", [1, 3])
def test_each_rank_streams_the_packed_documents_of_its_share(saved, tokenizer, ranks):
    documents = document_tokens(tokenizer)
    eos = np.array([eos_id(load_tokenizer(tokenizer))])
    for rank in range(ranks):
        samples = streamer(saved, tokenizer, rank, ranks)
        # Rows rank, rank + ranks, ...: only these are read, after an EOS, the input of the
        # first row's first token (a target like every other).
        share = [eos, *documents[rank::ranks]]
        for k, expected in enumerate(windows_of(share, 40 // ranks)):
            window, untrained = samples.take()
            assert (window == expected).all() and not untrained, (rank, k)


def test_streaming_resumes_at_its_saved_position_on_the_same_ranks(saved, tokenizer):
    uninterrupted = [streamer(saved, tokenizer, r, 2) for r in range(2)]
    expected = [[s.take()[0] for _ in range(20)] for s in uninterrupted]
    first = [streamer(saved, tokenizer, r, 2) for r in range(2)]
    for s in first:
        for _ in range(9):
            s.take()
    state = gathered(first)
    assert all(p["document"] > 1 for p in state["positions"])  # a resume skips documents
    for rank in range(2):
        resumed = streamer(saved, tokenizer, rank, 2)
        assert resumed.seek(state) is None
        for k in range(9, 20):
            assert (resumed.take()[0] == expected[rank][k]).all(), (rank, k)


def test_a_stream_resumed_on_2_then_3_then_1_ranks_trains_every_token_once(tmp_path):
    """Through the loader's saved state, as the trainer resumes. Every word of the corpus is a
    token of its own, so each (input, target) pair trained names the one token it trains."""
    rng = random.Random(1)
    texts, words = [], 0
    for _ in range(60):  # lengths that put the ranks in the middle of rows, and an empty row
        count = rng.choice([0, 1, 4, 13, 40])
        texts.append(" ".join(f"w{words + i}" for i in range(count)))
        words += count
    eos, vocab = 0, {EOS_TOKEN: 0, "[UNK]": 1} | {f"w{i}": i + 2 for i in range(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "words.json"))
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(tmp_path / "words")
    cfg = DataConfig(
        source="hf",
        path=str(tmp_path / "words"),
        streaming=True,
        tokenizer=str(tmp_path / "words.json"),
    )
    # The stream's pairs, as one uninterrupted run trains them: each row's words in order, each
    # row after an EOS (the end of the row before it on its rank) and followed by one.
    stream, row_of = Counter(), {}
    for row, text in enumerate(texts):
        ids = [vocab[word] for word in text.split()]
        row_of |= dict.fromkeys(ids, row)
        if ids:
            stream.update(zip([eos, *ids], [*ids, eos], strict=True))
    trained, not_targets = Counter(), 0

    def count(step) -> None:
        nonlocal not_targets
        for inputs, labels in step.micro_batches:
            pairs = zip(inputs.flatten().tolist(), labels.flatten().tolist(), strict=True)
            trained.update((i, t) for i, t in pairs if t != IGNORE_INDEX)
            not_targets += int((labels == IGNORE_INDEX).sum())

    state = None
    for ranks in [2, 3]:  # 6 windows a step
        loaders = stream_loaders(cfg, ranks, batch_size=6 // ranks)
        for loader in loaders:
            if state:
                loader.load_state_dict(state)
        for _ in range(2):
            for loader in loaders:
                count(loader.next_step())
        state = loaders[0].state_dict()
    assert state["streams"]["data"]["ranks"] == 3
    # One window a step, so the end loses none; the twin resumes at every step on one rank
    # again, after the rank-count changes, and reads the same windows.
    last, twin = stream_loaders(cfg, 1, batch_size=1)[0], stream_loaders(cfg, 1, batch_size=1)[0]
    last.load_state_dict(state)
    eos_before_a_begun_row = False
    with pytest.raises(KilnError, match="ran out on data rank 0"):
        while True:
            twin.load_state_dict(last.state_dict())
            step, again = last.next_step(), twin.next_step()
            for a, b in zip(step.micro_batches, again.micro_batches, strict=True):
                assert (a[0] == b[0]).all() and (a[1] == b[1]).all()
            count(step)
            inputs, labels = step.micro_batches[0]
            # The case a resume could get wrong: the window starts at a row's EOS and the next
            # row was begun on another rank, so its token before follows, not a target.
            eos_before_a_begun_row |= bool(inputs[0, 0] == eos and labels[0, 0] == IGNORE_INDEX)
    assert not_targets > 0 and eos_before_a_begun_row  # the seed makes both happen
    assert max(trained.values()) == 1 and set(trained) <= set(stream)  # nothing twice or made up
    # Nothing left out but the end of the stream that does not fill a window: exact.
    left = set(stream) - set(trained)
    end = last.state_dict()["streams"]["data"]["positions"][0]["document"]
    assert len(left) < SEQ and all(row_of[max(pair)] >= end for pair in left), sorted(left)


def test_streaming_through_the_loader_resumes_on_the_same_rank_count(saved, tokenizer):
    cfg = DataConfig(
        source="hf", path=str(saved), text_key="content", streaming=True, tokenizer=str(tokenizer)
    )

    two = stream_loaders(cfg, 2, batch_size=2, grad_accum_steps=2)
    for _ in range(3):
        steps = [lo.next_step() for lo in two]
    assert steps[0].sample_ids != steps[1].sample_ids
    state = two[0].state_dict()
    assert state == two[1].state_dict()
    assert len(state["streams"]["data"]["positions"]) == 2
    again = stream_loaders(cfg, 2, batch_size=2, grad_accum_steps=2)
    for lo in again:
        lo.load_state_dict(state)
    for _ in range(2):
        for lo, resumed in zip(two, again, strict=True):
            expected, got = lo.next_step(), resumed.next_step()
            for a, b in zip(expected.micro_batches, got.micro_batches, strict=True):
                assert (a[0] == b[0]).all() and (a[1] == b[1]).all()


def test_eager_is_tokenized_once_into_the_cache(saved, tokenizer, tmp_path):
    cfg = DataConfig(source="hf", path=str(saved), text_key="content", tokenizer=str(tokenizer))
    ensure_local_data(cfg, tmp_path)
    (source,) = open_training_data(
        cfg, seq_len=SEQ, model_vocab_size=4096, seed=0, cache_dir=tmp_path
    )
    dataset = source.samples.dataset
    assert (dataset.read(0, dataset.num_tokens) == token_stream(tokenizer)).all()
    index = dataset.path / "index.json"
    written = index.stat().st_mtime_ns
    ensure_local_data(cfg, tmp_path)
    assert index.stat().st_mtime_ns == written
    other_column = DataConfig(**{**cfg.__dict__, "text_key": "id"})
    with pytest.raises(KilnError, match="column 'id' holds"):
        ensure_local_data(other_column, tmp_path)


def test_bad_hf_sources_fail_before_training(saved, tokenizer, tmp_path):
    with pytest.raises(ConfigError, match=r"set data\.tokenizer"):
        load_config(DEBUG_CONFIG, ["--data.source=hf", f"--data.path={saved}"], world_size=1)
    cfg = DataConfig(source="hf", path=str(saved), text_key="text", tokenizer=str(tokenizer))
    with pytest.raises(KilnError, match=r"no column 'text' \(columns: content, id\)"):
        ensure_local_data(cfg, tmp_path)
    streaming = DataConfig(**{**cfg.__dict__, "text_key": "content", "streaming": True})
    with pytest.raises(ConfigError, match=r"model\.vocab_size \(256\) is smaller"):
        open_training_data(streaming, seq_len=SEQ, model_vocab_size=256, seed=0, cache_dir=tmp_path)
    missing = DataConfig(**{**cfg.__dict__, "path": str(tmp_path / "absent")})
    with pytest.raises(KilnError, match="absent"):
        ensure_local_data(missing, tmp_path)


def test_training_on_a_streamed_dataset_resumes_bitwise(saved, tokenizer, tmp_path):
    def trainer(run: str) -> Trainer:
        overrides = [
            "--data.source=hf",
            f"--data.path={saved}",
            f"--data.tokenizer={tokenizer}",
            "--data.text_key=content",
            "--data.streaming=true",
            "--train.seq_len=32",
            "--train.max_steps=6",
            "--checkpoint.interval=0",
            f"--metrics.run_dir={tmp_path / run}",
        ]
        return Trainer(load_config(DEBUG_CONFIG, overrides, world_size=1))

    whole = trainer("whole")
    expected = [whole.train_step()[0].item() for _ in range(6)]
    first = trainer("interrupted")
    for _ in range(2):
        first.train_step()
    first.save()
    first.train_step()  # lost, as in a crash
    second = trainer("interrupted")
    assert second.step == 2
    assert [second.train_step()[0].item() for _ in range(4)] == expected[2:]


def test_a_stream_of_files_at_a_url_reads_like_the_saved_dataset(
    saved, tokenizer, tmp_path, s3_env, s3_endpoint, monkeypatch
):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    lines = "".join(json.dumps({"content": text}) + "\n" for text in texts())
    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "code.jsonl").write_text(lines)
    make_bucket(s3_endpoint, "streams")
    fsspec.filesystem("s3").pipe("streams/code/part-0.jsonl", lines.encode())
    expected = streamer(saved, tokenizer, 1, 2)
    windows = [expected.take()[0] for _ in range(12)]
    with http_server(tmp_path / "web") as url:
        for path in (f"{url}/code.jsonl", "s3://streams/code/*.jsonl"):
            remote = StreamingSamples(
                entry(path, streaming=True),
                tokenizer_path=tokenizer,
                seq_len=SEQ,
                data_rank=1,
                data_ranks=2,
            )
            for k, window in enumerate(windows):
                assert (remote.take()[0] == window).all(), (path, k)


def test_a_stream_resumed_over_other_rows_is_refused(saved, tokenizer, tmp_path):
    first = streamer(saved, tokenizer)
    for _ in range(5):
        first.take()
    state = gathered([first])
    other = tmp_path / "other"
    datasets.Dataset.from_dict({"content": texts()[::-1]}).save_to_disk(other)
    resumed = StreamingSamples(entry(other, streaming=True), tokenizer_path=tokenizer, seq_len=SEQ)
    with pytest.raises(KilnError, match="is not the one this checkpoint was streaming"):
        resumed.seek(state)
    same = streamer(saved, tokenizer)
    assert same.seek(state) is None  # the same rows: the fingerprint matches
