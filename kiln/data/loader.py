"""Deterministic, resumable batches: which sample sits where is a function of (seed, global sample index).

The global batch of an optimizer step is the `global_batch` consecutive global sample indices
starting at `samples_seen`. Micro-batch m of data rank r reads the slice
[m * data_ranks * batch_size + r * batch_size, ... + batch_size) of it, so dp=4/accum=1 and
dp=1/accum=4 put every sample into the same optimizer step.

Each global sample picks a dataset of the mixture (`mixture.py`); its index within that dataset
is the dataset's running count, which the loader state carries. The main process plans each step
(cheap integer work, plus reading any streaming source, which is sequential); worker processes
read the planned samples from the memory-mapped shards, a few steps ahead. A step's plan carries
the state after it, so `state_dict()` is the position after the last step handed out however
far the workers have read ahead, and a different number of data ranks resumes at the same
global sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from kiln.config.sections import DataConfig
from kiln.data.dataset import TokenDataset
from kiln.data.mixture import choose_datasets, probabilities_at, within_dataset_indices
from kiln.resilience.preemption import detach_loader_worker
from kiln.train.loss import IGNORE_INDEX


class ShuffledSamples:
    """Sample k of a prepared dataset: a fresh seeded permutation every epoch."""

    streaming = False

    def __init__(self, dataset: TokenDataset, *, seed: int, shuffle: bool = True):
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle

    def sample(self, k: int) -> np.ndarray:
        n = len(self.dataset)
        epoch, offset = divmod(k, n)
        index = int(_permutation(self.seed, epoch, n)[offset]) if self.shuffle else offset
        return self.dataset.sample(index)


@lru_cache(maxsize=8)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


@dataclass
class Source:
    """One dataset of the mixture as the loader sees it."""

    name: str
    samples: Any  # ShuffledSamples, or a streaming source with take(k) / position()
    eos_id: int


@dataclass
class StepBatch:
    """This rank's part of one optimizer step."""

    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]  # (inputs, labels) per micro-batch
    dataset_ids: list[torch.Tensor]  # per micro-batch: each row's dataset index
    sample_ids: list[tuple[int, int, int]] = field(default_factory=list)  # (global, dataset, k)


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
    ):
        self.sources, self.cfg, self.seed = sources, cfg, seed
        self.batch_size, self.grad_accum_steps = batch_size, grad_accum_steps
        self.data_ranks, self.data_rank = data_ranks, data_rank
        self.num_workers, self.prefetch_steps, self.pin_memory = (
            num_workers,
            prefetch_steps,
            pin_memory,
        )
        self._state = {"step": 0, "samples_seen": 0, "counts": [0] * len(sources), "streams": {}}
        self._batches: Iterator[dict] | None = None

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.grad_accum_steps * self.data_ranks

    @property
    def samples_seen(self) -> int:
        return self._state["samples_seen"]

    def next_step(self) -> StepBatch:
        """This rank's micro-batches for the next optimizer step."""
        if self._batches is None:
            self._batches = iter(self._data_loader())
        out = next(self._batches)
        self._state = out["state"]
        tokens, labels = torch.from_numpy(out["tokens"]), torch.from_numpy(out["labels"])
        if self.pin_memory:  # page-locked, so the copies to the GPU can overlap compute
            tokens, labels = tokens.pin_memory(), labels.pin_memory()
        return StepBatch(
            micro_batches=[(tokens[m, :, :-1], labels[m]) for m in range(len(tokens))],
            dataset_ids=list(torch.from_numpy(out["datasets"])),
            sample_ids=[tuple(row) for row in out["sample_ids"]],
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "samples_seen": self._state["samples_seen"],
            "data_step": self._state["step"],
            "dataset_counts": dict(zip(self._names(), self._state["counts"], strict=True)),
            "streams": self._state["streams"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the saved position; a checkpoint of a single-dataset run (only
        `samples_seen`) counts all its samples as that dataset's."""
        counts = state.get("dataset_counts") or {self._names()[0]: state["samples_seen"]}
        step = state.get("data_step", state.get("step", 0))
        self._state = {
            "step": int(step),
            "samples_seen": int(state["samples_seen"]),
            "counts": [int(counts.get(name, 0)) for name in self._names()],
            "streams": dict(state.get("streams", {})),
        }
        for source in self.sources:
            if source.samples.streaming:
                source.samples.seek(self._state["streams"].get(source.name))
        self._batches = None

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
        first, n = state["samples_seen"], self.global_batch
        choices = choose_datasets(self.seed, first, n, probabilities_at(self.cfg, state["step"]))
        counts = np.array(state["counts"], dtype=np.int64)
        within = within_dataset_indices(choices, counts)
        rows = [
            (m * self.data_ranks + self.data_rank) * self.batch_size + j
            for m in range(self.grad_accum_steps)
            for j in range(self.batch_size)
        ]
        streamed = self._read_streams(first, choices, within, {first + r for r in rows})
        after = {
            "step": state["step"] + 1,
            "samples_seen": first + n,
            "counts": (counts + np.bincount(choices, minlength=len(counts))).tolist(),
            "streams": {s.name: s.samples.position() for s in self.sources if s.samples.streaming},
        }
        return {
            "rows": [(first + r, int(choices[r]), int(within[r])) for r in rows],
            "streamed": streamed,
            "micro": self.grad_accum_steps,
            "state": after,
        }

    def _read_streams(
        self, first: int, choices: np.ndarray, within: np.ndarray, wanted: set[int]
    ) -> dict[int, np.ndarray]:
        """Tokens of this rank's samples from streaming sources, by global sample index. Every
        rank reads every streamed sample in order (keeping only its own), so all ranks' stream
        positions agree."""
        out = {}
        for g, (d, k) in enumerate(zip(choices.tolist(), within.tolist(), strict=True), first):
            samples = self.sources[d].samples
            if samples.streaming:
                tokens = samples.take(k)
                if g in wanted:
                    out[g] = tokens
        return out


class _Plans:
    """The sampler: yields step plans from the loader's current state, advancing a copy of it."""

    def __init__(self, loader: BatchLoader):
        self.loader = loader

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
        rows = [
            streamed[g] if g in streamed else self.sources[d].samples.sample(k)
            for g, d, k in plan["rows"]
        ]
        tokens = np.stack(rows).reshape(plan["micro"], -1, rows[0].shape[0])
        datasets = np.array([d for _, d, _ in plan["rows"]]).reshape(plan["micro"], -1)
        labels = tokens[:, :, 1:].copy()
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


def _identity(item: Any) -> Any:
    return item
