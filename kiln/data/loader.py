"""Deterministic, resumable batches: which sample sits where is a function of (seed, global sample index).

The global batch of an optimizer step is the `global_batch` consecutive global sample indices
starting at `samples_seen`. Micro-batch m of data rank r reads the slice
[m * data_ranks * batch_size + r * batch_size, ... + batch_size) of it, so dp=4/accum=1 and
dp=1/accum=4 put every sample into the same optimizer step.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from kiln.data.dataset import TokenDataset


class BatchLoader:
    def __init__(
        self,
        dataset: TokenDataset,
        *,
        seed: int,
        batch_size: int,
        grad_accum_steps: int,
        data_ranks: int = 1,
        data_rank: int = 0,
        samples_seen: int = 0,
    ):
        self.dataset = dataset
        self.seed = seed
        self.batch_size = batch_size
        self.grad_accum_steps = grad_accum_steps
        self.data_ranks = data_ranks
        self.data_rank = data_rank
        self.samples_seen = samples_seen

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.grad_accum_steps * self.data_ranks

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (inputs, labels) micro-batches for the next optimizer step."""
        start = self.samples_seen
        micro = []
        for m in range(self.grad_accum_steps):
            first = start + (m * self.data_ranks + self.data_rank) * self.batch_size
            rows = np.stack(
                [
                    self.dataset.sample(self.sample_at(g))
                    for g in range(first, first + self.batch_size)
                ]
            )
            tokens = torch.from_numpy(rows)
            micro.append((tokens[:, :-1], tokens[:, 1:]))
        self.samples_seen += self.global_batch
        return micro

    def sample_at(self, global_index: int) -> int:
        """Dataset sample for a global sample index: a fresh seeded permutation every epoch."""
        epoch, offset = divmod(global_index, len(self.dataset))
        return int(_permutation(self.seed, epoch, len(self.dataset))[offset])

    def state_dict(self) -> dict[str, int]:
        return {"samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.samples_seen = int(state["samples_seen"])


@lru_cache(maxsize=2)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)
