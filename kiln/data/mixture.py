"""Which dataset each global sample comes from: a pure function of (seed, global sample index),
with the mixture weights of the phase the step is in (data annealing)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from kiln.config.sections import DataConfig, DataPhase

# Choices are drawn in blocks of this many global samples, one generator per block, so sample g's
# draw depends on g alone, not on the batch size or the number of ranks that read it.
BLOCK = 4096


def dataset_names(cfg: DataConfig) -> list[str]:
    return [entry.name for entry in cfg.datasets] or ["data"]


def phase_at(cfg: DataConfig, step: int) -> DataPhase | None:
    """The last phase that has started by optimizer step `step` (counted from 0)."""
    started = [phase for phase in cfg.phases if phase.start_step <= step]
    return started[-1] if started else None


def lr_scale_at(cfg: DataConfig, step: int) -> float:
    phase = phase_at(cfg, step)
    return phase.lr_scale if phase is not None else 1.0


def probabilities_at(cfg: DataConfig, step: int) -> np.ndarray:
    """Sampling probability of each dataset at `step`: weights (of the phase, where it names
    any; unnamed datasets then get 0) to the power 1/temperature, normalized."""
    if not cfg.datasets:
        return np.ones(1)
    weights = np.array([entry.weight for entry in cfg.datasets], dtype=np.float64)
    phase = phase_at(cfg, step)
    if phase is not None and phase.weights:
        weights = np.array([phase.weights.get(e.name, 0.0) for e in cfg.datasets], np.float64)
    weights = weights ** (1.0 / cfg.temperature)
    return weights / weights.sum()


def choose_datasets(seed: int, first: int, count: int, probabilities: np.ndarray) -> np.ndarray:
    """Dataset index of global samples first .. first+count-1 (int64)."""
    if len(probabilities) == 1:
        return np.zeros(count, dtype=np.int64)
    uniform = np.concatenate(
        [
            _uniforms(seed, block)[max(first - start, 0) : first + count - start]
            for block in range(first // BLOCK, (first + count - 1) // BLOCK + 1)
            for start in (block * BLOCK,)
        ]
    )
    edges = np.cumsum(probabilities)
    edges[-1] = 1.0  # rounding must never let a draw fall past the last dataset
    return np.searchsorted(edges, uniform, side="right").astype(np.int64)


@lru_cache(maxsize=4)
def _uniforms(seed: int, block: int) -> np.ndarray:
    return np.random.default_rng([seed, 0x6D1C, block]).random(BLOCK)


def within_dataset_indices(choices: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """For each chosen sample, how many samples its dataset had given out before it: the
    dataset's running count at the start plus its earlier choices in `choices`."""
    order = np.argsort(choices, kind="stable")
    ranks = np.empty_like(order)
    sorted_choices = choices[order]
    # Position within the run of equal dataset ids = index minus the run's first index.
    run_starts = np.searchsorted(sorted_choices, sorted_choices, side="left")
    ranks[order] = np.arange(len(choices)) - run_starts
    return counts[choices] + ranks
