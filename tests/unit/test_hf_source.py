"""Hugging Face datasets read at train time: eager (tokenized once into the run's cache) and
streaming (tokenized while training, position saved). Real `datasets` folders, real tokenizer."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pytest

from kiln.config import load_config
from kiln.config.sections import DataConfig, DatasetSource
from kiln.data import encode_ids, eos_id, load_tokenizer
from kiln.data.hf_source import StreamingSamples
from kiln.data.loader import BatchLoader
from kiln.data.sources import ensure_local_data, open_training_data
from kiln.errors import ConfigError, KilnError
from kiln.train.trainer import Trainer
from tests.conftest import DEBUG_CONFIG

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


def test_streaming_windows_are_the_packed_document_stream(saved, tokenizer):
    stream = token_stream(tokenizer)
    samples = StreamingSamples(entry(saved, streaming=True), tokenizer_path=tokenizer, seq_len=SEQ)
    for k in range(40):
        assert (samples.take(k) == stream[k * SEQ : k * SEQ + SEQ + 1]).all(), k
    skipping = StreamingSamples(entry(saved, streaming=True), tokenizer_path=tokenizer, seq_len=SEQ)
    assert (skipping.take(25) == stream[25 * SEQ : 26 * SEQ + 1]).all()


def test_streaming_resumes_at_its_saved_position(saved, tokenizer):
    source = entry(saved, streaming=True)
    uninterrupted = StreamingSamples(source, tokenizer_path=tokenizer, seq_len=SEQ)
    expected = [uninterrupted.take(k) for k in range(30)]
    first = StreamingSamples(source, tokenizer_path=tokenizer, seq_len=SEQ)
    for k in range(13):
        first.take(k)
    position = first.position()
    assert position["document"] > 0  # the resume skips documents, not only samples
    resumed = StreamingSamples(source, tokenizer_path=tokenizer, seq_len=SEQ)
    resumed.seek(position)
    for k in range(13, 30):
        assert (resumed.take(k) == expected[k]).all(), k


def test_streaming_through_the_loader_split_over_ranks_and_resumed(saved, tokenizer):
    cfg = DataConfig(
        source="hf", path=str(saved), text_key="content", streaming=True, tokenizer=str(tokenizer)
    )

    def loader(data_ranks=1, data_rank=0):
        (source,) = open_training_data(
            cfg,
            seq_len=SEQ,
            model_vocab_size=4096,
            seed=0,
            cache_dir=Path("unused"),
        )
        return BatchLoader(
            [source],
            cfg,
            seed=0,
            batch_size=4 // data_ranks,
            grad_accum_steps=2,
            data_ranks=data_ranks,
            data_rank=data_rank,
        )

    one, ranks = loader(), [loader(2, 0), loader(2, 1)]
    for _ in range(3):
        whole = one.next_step()
        parts = [rank.next_step() for rank in ranks]
        for m, (inputs, _) in enumerate(whole.micro_batches):
            rows = [part.micro_batches[m][0] for part in parts]
            assert (inputs == np.concatenate(rows)).all()
    resumed = loader()
    resumed.load_state_dict(one.state_dict())
    for _ in range(2):
        expected, got = one.next_step(), resumed.next_step()
        assert expected.sample_ids == got.sample_ids
        for (a, _), (b, _) in zip(expected.micro_batches, got.micro_batches, strict=True):
            assert (a == b).all()


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
