"""Deterministic, resumable batches: which sample sits where is a function of (seed, global sample index).

The global batch of an optimizer step is the consecutive global sample indices starting at
`samples_seen`, as many as the step's shape holds (`kiln/config/training_schedule.py`: the batch
ramp sets the micro-batches, a sequence-length phase their rows and length, both from the tokens
read so far). Micro-batch m of data rank r reads the slice
[m * data_ranks * batch_size + r * batch_size, ... + batch_size) of it, so dp=4/accum=1 and
dp=1/accum=4 put every sample into the same optimizer step.

Each global sample picks a dataset of the mixture (`mixture.py`); its index within that dataset
is the dataset's running count, which the loader state carries. The main process plans each step
(cheap integer work, plus reading this rank's share of any streaming source, in order); worker processes
read the planned samples from the memory-mapped shards, a few steps ahead. A step's plan carries
the state after it, so `state_dict()` is the position after the last step handed out however
far the workers have read ahead, and a different number of data ranks resumes at the same
global sample.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from kiln.config import JobConfig
from kiln.config.sections import DataConfig, TrainConfig
from kiln.config.training_schedule import TrainingSchedule
from kiln.data.dataset import TokenDataset
from kiln.data.mixture import choose_datasets, probabilities_at, within_dataset_indices
from kiln.data.permutation import permute
from kiln.data.workers import detach_loader_worker
from kiln.errors import KilnError
from kiln.log import info
from kiln.tokens import IGNORE_INDEX

# The sample order's name in the loader state: a checkpoint continues only under the same order.
SHUFFLE = "feistel-v1"


class ShuffledSamples:
    """Sample k of a prepared dataset: epoch k // n reads the dataset in the order of a seeded
    permutation, a new one every epoch, computed per index (`permutation.py`)."""

    streaming = False

    def __init__(self, dataset: TokenDataset, *, seed: int, shuffle: bool = True):
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle

    @property
    def seq_len(self) -> int:
        return self.dataset.seq_len

    def indices(self, ks: np.ndarray) -> np.ndarray:
        """Dataset index of each sample number in `ks` (int64)."""
        n = len(self.dataset)
        ks = np.asarray(ks, dtype=np.int64)
        if not self.shuffle:
            return ks % n
        epochs, offsets = np.divmod(ks, n)
        out = np.empty_like(ks)
        for epoch in np.unique(epochs).tolist():  # a step spans one epoch, rarely two
            at = epochs == epoch
            out[at] = permute(offsets[at], n, seed=self.seed, epoch=epoch)
        return out

    def read(self, ks: list[int], *, seq_len: int | None = None) -> list[np.ndarray]:
        """Tokens of samples `ks`, with one permutation evaluation for all of them. With a
        shorter `seq_len` (a sequence-length phase), sample k is window k % r of the dataset's
        sample k // r, r = its seq_len / `seq_len`: whichever phase reads it, a sample's tokens
        are read once per epoch."""
        length = seq_len or self.dataset.seq_len
        per_sample = self.dataset.seq_len // length
        samples, windows = np.divmod(np.asarray(ks, dtype=np.int64), per_sample)
        return [
            self.dataset.window(i, offset=w * length, length=length)
            for i, w in zip(self.indices(samples).tolist(), windows.tolist(), strict=True)
        ]

    def sample(self, k: int) -> np.ndarray:
        return self.read([k])[0]


@dataclass
class Source:
    """One dataset of the mixture as the loader sees it."""

    name: str
    samples: Any  # ShuffledSamples, or a streaming source with take() / position()
    eos_id: int


@dataclass
class StepBatch:
    """This rank's part of one optimizer step."""

    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]  # (inputs, labels) per micro-batch
    dataset_ids: list[torch.Tensor]  # per micro-batch: each row's dataset index
    sample_ids: list[tuple[int, int, int]] = field(default_factory=list)  # (global, dataset, k)
    # The tokens (positions) every data rank has read through this step: where the
    # learning-rate schedule stands under scheduler.unit = "tokens".
    tokens_after: int = 0


class BatchLoader:
    def __init__(
        self,
        sources: list[Source],
        cfg: DataConfig,
        *,
        seed: int,
        batch_size: int,
        grad_accum_steps: int,
        data_ranks: int = 1,
        data_rank: int = 0,
        num_workers: int = 0,
        prefetch_steps: int = 2,
        pin_memory: bool = False,
        gather: Callable[[Any], list[Any]] | None = None,
        schedule: TrainingSchedule | None = None,
    ):
        self.sources, self.cfg, self.seed = sources, cfg, seed
        # Every step's shape; without one, each step is `grad_accum_steps` micro-batches of
        # `batch_size` samples of the data's own length.
        fixed = TrainConfig(
            seq_len=sources[0].samples.seq_len,
            batch_size=batch_size,
            grad_accum_steps=grad_accum_steps,
        )
        self.schedule = schedule or TrainingSchedule(fixed, data_ranks=data_ranks)
        self.data_ranks, self.data_rank = data_ranks, data_rank
        self.num_workers, self.prefetch_steps, self.pin_memory = (
            num_workers,
            prefetch_steps,
            pin_memory,
        )
        # Every rank's object, in rank order (a collective over all ranks), or None in one
        # process: streaming ranks agree on failures and save each other's positions with it.
        self.gather = gather
        self._state = {
            "step": 0,
            "samples_seen": 0,
            "counts": [0] * len(sources),
            "streams": {s.name: s.samples.position() for s in self._streams()},
            "tokens": 0,
            "seq_len": self.schedule.train.seq_len,  # the length `counts` are in
        }
        self._batches: Iterator[dict] | None = None

    @classmethod
    def for_training(
        cls,
        sources: list[Source],
        cfg: JobConfig,
        *,
        data_ranks: int,
        data_rank: int,
        pin: bool,
        gather: Callable[[Any], list[Any]] | None = None,
    ) -> BatchLoader:
        """The loader of a training run: its batch, seed and data settings from `cfg`."""
        return cls(
            sources,
            cfg.data,
            seed=cfg.train.seed,
            batch_size=cfg.train.batch_size,
            grad_accum_steps=cfg.train.grad_accum_steps,
            data_ranks=data_ranks,
            data_rank=data_rank,
            num_workers=cfg.data.num_workers,
            prefetch_steps=cfg.data.prefetch_steps,
            pin_memory=pin,
            gather=gather,
            schedule=TrainingSchedule(cfg.train, data_ranks=data_ranks),
        )

    @property
    def samples_seen(self) -> int:
        return self._state["samples_seen"]

    def next_step(self) -> StepBatch:
        """This rank's micro-batches for the next optimizer step."""
        if self._batches is None:
            self._batches = iter(self._data_loader())
        out = self._agreed(self._batches) if self._streams() else next(self._batches)
        self._state = out["state"]
        tokens, labels = torch.from_numpy(out["tokens"]), torch.from_numpy(out["labels"])
        if self.pin_memory:  # page-locked, so the copies to the GPU can overlap compute
            tokens, labels = tokens.pin_memory(), labels.pin_memory()
        return StepBatch(
            micro_batches=[(tokens[m, :, :-1], labels[m]) for m in range(len(tokens))],
            dataset_ids=list(torch.from_numpy(out["datasets"])),
            sample_ids=[tuple(row) for row in out["sample_ids"]],
            tokens_after=out["state"]["tokens"],
        )

    def _streams(self) -> list[Source]:
        return [source for source in self.sources if source.samples.streaming]

    def _agreed(self, batches: Iterator[dict]) -> dict:
        """The next step, or every rank's error when one rank's stream share ran out: each
        rank reads its own share, so they need not run out on the same step."""
        out, failure = None, None
        try:
            out = next(batches)
        except Exception as error:  # any rank's failure stops all: the others would wait
            failure = (
                str(error) if isinstance(error, KilnError) else f"{type(error).__name__}: {error}"
            )
        failures = self.gather(failure) if self.gather else [failure]
        if any(failures):
            raise KilnError(next(f for f in failures if f))
        return out

    def state_dict(self) -> dict[str, Any]:
        """The position after the last step handed out; on every rank the same (a collective
        when a streaming source saves every data rank's position)."""
        return {
            "samples_seen": self._state["samples_seen"],
            "data_step": self._state["step"],
            "dataset_counts": dict(zip(self._names(), self._state["counts"], strict=True)),
            "streams": self._gathered_streams(),
            "shuffle": SHUFFLE,
            "data_tokens": self._state["tokens"],
            "data_seq_len": self._state["seq_len"],
        }

    def _gathered_streams(self) -> dict[str, Any]:
        """Each streaming source's layout and every data rank's position in it."""
        if not self._streams():
            return {}
        mine = (self.data_rank, self._state["streams"])
        everyone = dict(self.gather(mine) if self.gather else [mine])
        assert sorted(everyone) == list(range(self.data_ranks)), sorted(everyone)
        return {
            source.name: source.samples.gathered_state(
                [everyone[rank][source.name] for rank in range(self.data_ranks)]
            )
            for source in self._streams()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the saved position; a checkpoint of a single-dataset run (only
        `samples_seen`) counts all its samples as that dataset's."""
        self.check_order(state)
        counts = state.get("dataset_counts") or {self._names()[0]: state["samples_seen"]}
        step = state.get("data_step", state.get("step", 0))
        # A checkpoint written before the schedules read whole samples at every step.
        seq_len = int(state.get("data_seq_len", self.schedule.train.seq_len))
        self._state = {
            "step": int(step),
            "samples_seen": int(state["samples_seen"]),
            "counts": [int(counts.get(name, 0)) for name in self._names()],
            "streams": dict(state.get("streams", {})),
            "tokens": int(state.get("data_tokens", int(state["samples_seen"]) * seq_len)),
            "seq_len": seq_len,
        }
        for source in self._streams():
            note = source.samples.seek(self._state["streams"].get(source.name))
            if note and self.data_rank == 0:
                info(f"streaming dataset {source.name!r}: {note}", stdout=True)
        self._state["streams"] = {s.name: s.samples.position() for s in self._streams()}
        self._batches = None

    def check_order(self, state: dict[str, Any]) -> None:
        """Refuse a saved state whose sample order is not this loader's: counts continue an order
        only under the shuffle that made it; under another they would repeat and skip samples.
        Cheap, so a resume can call it before loading any weights."""
        saved = state.get("shuffle")
        if saved == SHUFFLE or not any(self._shuffles(s.samples) for s in self.sources):
            return
        written = repr(saved) if saved else "a materialized per-epoch permutation (an older kiln)"
        raise KilnError(
            f"cannot continue the data order of this checkpoint: it was written by a kiln that "
            f"shuffles with {written}, and this kiln shuffles with {SHUFFLE!r}, so resuming "
            "would repeat some samples and skip others. Resume with the kiln version that wrote "
            "it, or start a new run from its weights: checkpoint.load_path = <its step "
            "directory> and checkpoint.model_only = true, with a new checkpoint.dir"
        )

    @staticmethod
    def _shuffles(samples: Any) -> bool:
        return not samples.streaming and samples.shuffle

    def _names(self) -> list[str]:
        return [source.name for source in self.sources]

    def _data_loader(self) -> DataLoader:
        workers = self.num_workers if not any(s.samples.streaming for s in self.sources) else 0
        return DataLoader(
            _PlannedReader(self.sources, document_mask=self.cfg.document_mask),
            sampler=_Plans(self),
            batch_size=None,
            collate_fn=_identity,
            num_workers=workers,
            prefetch_factor=self.prefetch_steps if workers else None,
            worker_init_fn=detach_loader_worker,
        )

    def plan(self, state: dict[str, Any]) -> dict[str, Any]:
        """Rows this rank reads at the step `state` points at, and the state after that step."""
        shape = self.schedule.shape_at(state["tokens"])
        first, n = state["samples_seen"], shape.sequences(self.data_ranks)
        choices = choose_datasets(self.seed, first, n, probabilities_at(self.cfg, state["step"]))
        counts = _counts_at(state["counts"], was=state["seq_len"], now=shape.seq_len)
        within = within_dataset_indices(choices, counts)
        rows = [
            (m * self.data_ranks + self.data_rank) * shape.batch_size + j
            for m in range(shape.micro_batches)
            for j in range(shape.batch_size)
        ]
        streamed = self._read_streams(first, choices, rows)
        after = {
            "step": state["step"] + 1,
            "samples_seen": first + n,
            "counts": (counts + np.bincount(choices, minlength=len(counts))).tolist(),
            "streams": {s.name: s.samples.position() for s in self.sources if s.samples.streaming},
            "tokens": state["tokens"] + shape.tokens(self.data_ranks),
            "seq_len": shape.seq_len,
        }
        return {
            "rows": [(first + r, int(choices[r]), int(within[r])) for r in rows],
            "streamed": streamed,
            "micro": shape.micro_batches,
            "seq_len": shape.seq_len,
            "state": after,
        }

    def _read_streams(
        self, first: int, choices: np.ndarray, rows: list[int]
    ) -> dict[int, tuple[np.ndarray, list[int]]]:
        """This rank's samples from streaming sources, by global sample index: each rank reads
        the next windows of its own share of the stream, in row order (with the targets of each
        that are not trained on, see `StreamingSamples.take`)."""
        out = {}
        for row in rows:
            samples = self.sources[int(choices[row])].samples
            if samples.streaming:
                out[first + row] = samples.take()
        return out


def _counts_at(counts: list[int], *, was: int, now: int) -> np.ndarray:
    """Each dataset's samples read, in samples of length `now` when they were counted in `was`:
    at a sequence-length phase's start. Rounded up: a longer length starts at the next whole
    sample, skipping the rest of one it had begun (under one sample per dataset)."""
    counts = np.array(counts, dtype=np.int64)
    return counts if was == now else -((-counts * was) // now)


class _Plans:
    """The sampler: yields step plans from the loader's current state, advancing a copy of it."""

    def __init__(self, loader: BatchLoader):
        # A weak reference: the loader holds the DataLoader iterator, which holds this sampler's
        # generator. A strong one would make a cycle that only the garbage collector frees, in
        # an order that can close the worker queues before the iterator tells the workers to
        # stop: each worker then waits out DataLoader's 5 s timeout before it is killed.
        self.loader = weakref.proxy(loader)

    def __iter__(self) -> Iterator[dict]:
        state = self.loader._state
        while True:
            plan = self.loader.plan(state)
            state = plan["state"]
            yield plan


class _PlannedReader:
    """Map-style dataset whose index is a plan: reads the planned rows (in a worker process)."""

    def __init__(self, sources: list[Source], *, document_mask: bool):
        self.sources, self.document_mask = sources, document_mask

    def __getitem__(self, plan: dict) -> dict[str, Any]:
        """The step's arrays as numpy: pickled through the worker's pipe they reach the training
        process 2-3x faster than torch tensors in shared memory (benchmarks/data.md)."""
        streamed = plan["streamed"]
        windows = {g: window for g, (window, _) in streamed.items()}
        rows = self._read(plan["rows"], windows, seq_len=plan["seq_len"])
        tokens = np.stack(rows).reshape(plan["micro"], -1, rows[0].shape[0])
        datasets = np.array([d for _, d, _ in plan["rows"]]).reshape(plan["micro"], -1)
        labels = tokens[:, :, 1:].copy()
        for row, (g, _, _) in zip(labels.reshape(len(rows), -1), plan["rows"], strict=True):
            if g in streamed:  # a streamed window's inputs that are not targets there
                row[streamed[g][1]] = IGNORE_INDEX
        if self.document_mask:
            # The token after an end-of-document belongs to the next document: not a target.
            eos = np.array([self.sources[d].eos_id for _, d, _ in plan["rows"]])
            labels[tokens[:, :, :-1] == eos.reshape(plan["micro"], -1, 1)] = IGNORE_INDEX
        return {
            "tokens": tokens,
            "labels": labels,
            "datasets": datasets,
            "sample_ids": plan["rows"],
            "state": plan["state"],
        }

    def _read(
        self, rows: list[tuple[int, int, int]], streamed: dict[int, np.ndarray], *, seq_len: int
    ) -> list[np.ndarray]:
        """Tokens of each planned row: streamed ones as read, the others from their dataset,
        with one permutation evaluation per dataset."""
        out = [streamed.get(g) for g, _, _ in rows]
        for d, source in enumerate(self.sources):
            wanted = [i for i, (g, row_d, _) in enumerate(rows) if row_d == d and g not in streamed]
            if wanted:
                tokens = source.samples.read([rows[i][2] for i in wanted], seq_len=seq_len)
                for i, t in zip(wanted, tokens, strict=True):
                    out[i] = t
        return out


def _identity(item: Any) -> Any:
    return item
