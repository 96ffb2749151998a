"""The loader: mixtures and phases as functions of the global sample index, worker processes,
exact resume, and resuming with a different number of data-parallel ranks."""

from __future__ import annotations

import functools
import re
import tracemalloc
from collections import Counter
from itertools import pairwise

import numpy as np
import pytest
import torch

from kiln.config.sections import DataConfig, DataPhase, DatasetSource, SeqLenPhase, TrainConfig
from kiln.config.training_schedule import TrainingSchedule
from kiln.data import ShardWriter, TokenDataset, train_bpe_tokenizer
from kiln.data.loader import SHUFFLE, BatchLoader, ShuffledSamples, Source
from kiln.data.mixture import (
    choose_datasets,
    lr_scale_at,
    probabilities_at,
    within_dataset_indices,
)
from kiln.data.permutation import permute
from kiln.data.sources import open_eval_data, open_training_data
from kiln.errors import ConfigError, KilnError
from kiln.tokens import IGNORE_INDEX

SEQ = 8


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, TokenDataset]:
    root = tmp_path_factory.mktemp("mix")
    tokenizer = root / "tokenizer.json"
    train_bpe_tokenizer(["a few words of text"] * 4, vocab_size=300).save(str(tokenizer))
    out = {}
    for seed, name in enumerate(("web", "code")):
        rng = np.random.default_rng(seed)
        with ShardWriter(root / name, tokenizer, shard_tokens=64) as writer:
            for _ in range(60):
                writer.add_document(rng.integers(3, 259, size=int(rng.integers(1, 12))).tolist())
        out[name] = TokenDataset(root / name, SEQ)
    return out


def mixture(weights=(3.0, 1.0), **kwargs) -> DataConfig:
    entries = [
        DatasetSource(name=name, path=name, weight=w)
        for name, w in zip(("web", "code"), weights, strict=True)
    ]
    return DataConfig(datasets=entries, **kwargs)


def sources(datasets, cfg: DataConfig) -> list[Source]:
    return [
        Source(e.name, ShuffledSamples(datasets[e.name], seed=i), datasets[e.name].eos_id)
        for i, e in enumerate(cfg.datasets)
    ]


def loader(datasets, cfg, **kwargs) -> BatchLoader:
    kwargs = {"seed": 5, "batch_size": 2, "grad_accum_steps": 1, **kwargs}
    return BatchLoader(sources(datasets, cfg), cfg, **kwargs)


def run(loaders: list[BatchLoader], steps: int) -> list[list[tuple[int, int, int]]]:
    """Per step, the sample ids every rank read, sorted by global index."""
    return [sorted(s for ld in loaders for s in ld.next_step().sample_ids) for _ in range(steps)]


def test_mixture_follows_weights_temperature_and_phases():
    cfg = mixture(temperature=2.0, phases=[DataPhase(start_step=10, weights={"code": 1.0})])
    assert probabilities_at(cfg, 0) == pytest.approx([3**0.5 / (3**0.5 + 1), 1 / (3**0.5 + 1)])
    assert probabilities_at(cfg, 10).tolist() == [0.0, 1.0]  # unnamed datasets get weight 0
    choices = choose_datasets(0, 0, 20_000, probabilities_at(mixture(), 0))
    assert np.mean(choices == 0) == pytest.approx(0.75, abs=0.01)
    cfg.phases.append(DataPhase(start_step=20, weights={"web": 1.0}, lr_scale=0.1))
    assert [lr_scale_at(cfg, s) for s in (0, 10, 25)] == [1.0, 1.0, 0.1]


def test_choice_of_a_sample_depends_on_its_index_alone():
    p = np.array([0.5, 0.3, 0.2])
    whole = choose_datasets(1, 0, 10_000, p)
    pieces = np.concatenate([choose_datasets(1, s, 7, p) for s in range(0, 10_003, 7)])
    assert np.array_equal(whole, pieces[:10_000])


def test_within_dataset_indices_count_per_dataset():
    got = within_dataset_indices(np.array([1, 0, 1, 1, 0]), np.array([10, 20]))
    assert got.tolist() == [20, 10, 21, 22, 11]


def test_resume_with_fewer_data_ranks_continues_at_the_same_global_sample(datasets):
    cfg = mixture()
    reference = run([loader(datasets, cfg, batch_size=8)], 8)
    four = [loader(datasets, cfg, data_ranks=4, data_rank=r) for r in range(4)]
    first = run(four, 3)
    states = [ld.state_dict() for ld in four]
    assert all(state == states[0] for state in states)
    two = [
        loader(datasets, cfg, batch_size=2, grad_accum_steps=2, data_ranks=2, data_rank=r)
        for r in range(2)
    ]
    for ld in two:
        ld.load_state_dict(states[0])
    assert first + run(two, 5) == reference
    ids = [(d, k) for step in reference for _, d, k in step]
    assert len(set(ids)) == len(ids)  # within the first epoch no sample repeats
    assert Counter(d for d, _ in ids)[0] > Counter(d for d, _ in ids)[1]


def test_workers_prefetch_and_resume_exactly(datasets):
    cfg = mixture(phases=[DataPhase(start_step=2, weights={"code": 1.0})])
    straight = loader(datasets, cfg, num_workers=2, prefetch_steps=3)
    expected = [straight.next_step() for _ in range(6)]
    first = loader(datasets, cfg, num_workers=2, prefetch_steps=3)
    for _ in range(3):
        first.next_step()  # the workers have read further ahead than this
    resumed = loader(datasets, cfg, num_workers=0)
    resumed.load_state_dict(first.state_dict())
    for want in expected[3:]:
        got = resumed.next_step()
        assert got.sample_ids == want.sample_ids
        for (x, y), (wx, wy) in zip(got.micro_batches, want.micro_batches, strict=True):
            assert torch.equal(x, wx) and torch.equal(y, wy)
    assert {d for _, d, _ in expected[4].sample_ids} == {1}  # the phase switched to code only


def test_single_dataset_checkpoint_state_loads(datasets):
    cfg = mixture(weights=(1.0, 0.0))
    ld = loader(datasets, cfg)
    # What kiln wrote before mixtures, with the shuffle marker of today's order.
    ld.load_state_dict({"step": 4, "samples_seen": 8, "shuffle": SHUFFLE})
    assert ld.state_dict()["dataset_counts"] == {"web": 8, "code": 0}
    assert ld.next_step().sample_ids[0][0] == 8


def test_document_mask_ignores_labels_that_cross_a_boundary(datasets):
    cfg = mixture(weights=(1.0, 0.0), document_mask=True)
    batch = loader(datasets, cfg, batch_size=16).next_step()
    (inputs, labels), eos = batch.micro_batches[0], datasets["web"].eos_id
    assert (inputs == eos).any()
    assert (labels[inputs == eos] == IGNORE_INDEX).all()
    assert (labels[inputs != eos] != IGNORE_INDEX).all()
    plain = loader(datasets, mixture(weights=(1.0, 0.0)), batch_size=16).next_step()
    assert (plain.micro_batches[0][1] != IGNORE_INDEX).all()


def test_opening_checks_tokenizers_across_the_mixture(datasets, tmp_path):
    other = tmp_path / "other.json"
    train_bpe_tokenizer(["quite different words here"] * 4, vocab_size=280).save(str(other))
    with ShardWriter(tmp_path / "books", other) as writer:
        writer.add_document(list(range(3, 40)))
    web = datasets["web"].path
    open_data = functools.partial(
        open_training_data, seq_len=SEQ, model_vocab_size=512, seed=0, cache_dir=tmp_path
    )
    entries = [
        DatasetSource(name="web", path=str(web)),
        DatasetSource(name="books", path=str(tmp_path / "books")),
    ]
    with pytest.raises(
        ConfigError, match=r"tokenized with different tokenizers \(web: .*; books: "
    ):
        open_data(DataConfig(datasets=entries))
    with pytest.raises(
        ConfigError, match=re.escape(f"{other} is not the tokenizer {web} was prepared")
    ):
        open_data(DataConfig(source="prepared", path=str(web), tokenizer=str(other)))
    assert len(open_data(DataConfig(datasets=entries[:1], tokenizer=str(web / "tokenizer.json"))))
    open_eval = functools.partial(
        open_eval_data, data=DataConfig(path=str(web)), seq_len=SEQ, model_vocab_size=512
    )
    with pytest.raises(ConfigError, match="was tokenized with another tokenizer than the training"):
        open_eval(str(tmp_path / "books"), tokenizer_path=web / "tokenizer.json")
    with pytest.raises(ConfigError, match="there is no held-out data"):
        open_eval("", tokenizer_path=web / "tokenizer.json")
    assert open_eval(str(web), tokenizer_path=web / "tokenizer.json").path == web


class FakeDataset:
    """n samples without any data behind them: sample i is [i, i]."""

    def __init__(self, n: int):
        self.n, self.eos_id, self.seq_len = n, 0, 1

    def __len__(self) -> int:
        return self.n

    def window(self, i: int, *, offset: int, length: int) -> np.ndarray:
        assert 0 <= i < self.n and (offset, length) == (0, 1)
        return np.array([i, i], dtype=np.int64)


def test_each_epoch_reads_every_sample_once_in_a_new_order():
    n = 1000
    samples = ShuffledSamples(FakeDataset(n), seed=3)
    epochs = [samples.indices(np.arange(e * n, (e + 1) * n)) for e in range(3)]
    for e, order in enumerate(epochs):
        assert np.array_equal(np.sort(order), np.arange(n))
        assert np.array_equal(order, permute(np.arange(n), n, seed=3, epoch=e))
    assert np.mean(epochs[0] == epochs[1]) < 0.01
    across = np.arange(n - 5, n + 5)  # one step may straddle two epochs
    assert samples.indices(across).tolist() == [samples.sample(k)[0] for k in across]
    plain = ShuffledSamples(FakeDataset(n), seed=3, shuffle=False)
    assert plain.indices(np.array([0, 5, n + 7])).tolist() == [0, 5, 7]


def test_a_loader_over_two_billion_samples_needs_no_memory_for_the_order():
    n = 2_000_000_000
    cfg = DataConfig()
    tracemalloc.start()
    try:
        ld = BatchLoader(
            [Source("data", ShuffledSamples(FakeDataset(n), seed=1), 0)],
            cfg,
            seed=1,
            batch_size=64,
            grad_accum_steps=2,
        )
        ld.load_state_dict(
            {**ld.state_dict(), "samples_seen": n - 64, "dataset_counts": {"data": n - 64}}
        )
        batch = ld.next_step()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # the old per-epoch permutation was 16 GB
    ks = np.array([k for _, _, k in batch.sample_ids])
    assert ks.tolist() == list(range(n - 64, n + 64))  # the step straddles epochs 0 and 1
    read = torch.cat([inputs for inputs, _ in batch.micro_batches]).flatten().numpy()
    expected = [permute(ks[:64], n, seed=1, epoch=0), permute(ks[64:] - n, n, seed=1, epoch=1)]
    assert np.array_equal(read, np.concatenate(expected))


def test_a_checkpoint_of_another_shuffle_is_refused(datasets):
    cfg = mixture()
    state = loader(datasets, cfg).state_dict()
    assert state["shuffle"] == SHUFFLE
    legacy = {k: v for k, v in state.items() if k != "shuffle"}
    for saved, named in (
        (legacy, "a materialized per-epoch permutation"),
        ({**state, "shuffle": "x-v9"}, "'x-v9'"),
    ):
        with pytest.raises(
            KilnError, match=re.escape(named) + ".*kiln version that wrote it.*model_only"
        ):
            loader(datasets, cfg).load_state_dict(saved)
    # Reading in order (held-out data) does not depend on the shuffle.
    unshuffled = BatchLoader(
        [Source("web", ShuffledSamples(datasets["web"], seed=0, shuffle=False), 0)],
        mixture(weights=(1.0, 0.0)),
        seed=0,
        batch_size=2,
        grad_accum_steps=1,
    )
    unshuffled.load_state_dict(legacy)
    assert unshuffled.next_step().sample_ids[0][0] == state["samples_seen"]


def test_dropping_a_loader_mid_run_stops_its_workers_at_once(datasets):
    """Nothing but the loader holds its DataLoader iterator: dropping the loader shuts the
    workers down right away, not when the garbage collector gets to a reference cycle (in an
    order that left each worker waiting out DataLoader's 5 s timeout)."""
    ld = loader(datasets, mixture(), num_workers=2, prefetch_steps=3)
    ld.next_step()
    workers = list(ld._batches._workers)
    assert all(worker.is_alive() for worker in workers)
    del ld
    assert not any(worker.is_alive() for worker in workers)


def test_a_shorter_phase_reads_samples_in_pieces_and_no_token_twice(datasets):
    """A sequence-length phase at half the samples' length reads sample k // 2's piece k % 2;
    the next phase starts at the next whole sample (the half one begun is skipped), and within
    the epoch no token is read twice."""
    cfg = DataConfig(datasets=[DatasetSource(name="web", path="web")])
    phase = SeqLenPhase(seq_len=SEQ // 2, until_tokens=3 * 3 * SEQ // 2, batch_size=3)
    train = TrainConfig(seq_len=SEQ, batch_size=2, grad_accum_steps=1, seq_len_schedule=[phase])
    ld = loader(datasets, cfg, schedule=TrainingSchedule(train, data_ranks=1))
    samples, dataset = ld.sources[0].samples, datasets["web"]
    read, first_long = [], None
    for _ in range(3 + 10):  # the phase's 9 pieces (4.5 samples), then 20 whole samples
        batch = ld.next_step()
        ((inputs, labels),) = batch.micro_batches
        length = inputs.shape[1]
        for row, target, (_, _, k) in zip(inputs, labels, batch.sample_ids, strict=True):
            pieces = SEQ // length
            start = int(samples.indices(np.array([k // pieces]))[0]) * SEQ + k % pieces * length
            assert row.tolist() == dataset.read(start, start + length).tolist()
            assert target.tolist() == dataset.read(start + 1, start + length + 1).tolist()
            read.append((start, start + length))
            if length == SEQ and first_long is None:
                first_long = k
    assert first_long == 5  # pieces 0-8 are samples 0-3 and half of 4
    assert len(read) == 29 and len(dataset) > 25  # one epoch
    spans = sorted(read)
    assert all(end <= start for (_, end), (start, _) in pairwise(spans))
