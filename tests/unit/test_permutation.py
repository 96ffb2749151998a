"""The per-index shuffle: a bijection of [0, n) for every n, a pure function of (seed, epoch,
position), and free of any state that grows with n."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from kiln.data.permutation import permute

SMALL = sorted({*range(1, 70), *(2**b + d for b in range(2, 13) for d in (-1, 0, 1)), 1000})


@pytest.mark.parametrize("seed", [0, 7, -3, 2**63 + 5])
def test_every_small_size_is_permuted_exactly(seed):
    for n in SMALL:
        for epoch in (0, 1):
            image = permute(np.arange(n), n, seed=seed, epoch=epoch)
            assert np.array_equal(np.sort(image), np.arange(n)), (n, epoch)
            assert image.dtype == np.int64


@pytest.mark.parametrize("n", [2_000_000_000, 2**31 + 1, 2**40 - 1, 2**40, 2**40 + 1])
def test_huge_sizes_give_distinct_indices_below_n(n):
    rng = np.random.default_rng(n % 1000)
    positions = np.unique(np.concatenate([rng.integers(0, n, 200_000), [0, 1, n - 2, n - 1]]))
    image = permute(positions, n, seed=11, epoch=3)
    assert len(np.unique(image)) == len(positions)
    assert image.min() >= 0 and image.max() < n


def test_order_depends_on_seed_epoch_and_position_only():
    n = 10_007
    whole = permute(np.arange(n), n, seed=5, epoch=2)
    pieces = np.concatenate(
        [permute(np.arange(s, min(s + 97, n)), n, seed=5, epoch=2) for s in range(0, n, 97)]
    )
    assert np.array_equal(whole, pieces)
    assert np.array_equal(whole[[9, 3, 9]], permute(np.array([9, 3, 9]), n, seed=5, epoch=2))
    for other in (
        permute(np.arange(n), n, seed=6, epoch=2),
        permute(np.arange(n), n, seed=5, epoch=3),
    ):
        assert np.mean(other == whole) < 0.01  # unrelated orders, not shifted copies


def test_orders_look_uniformly_random():
    n, seeds = 12, 6000
    first = np.array([permute(np.array([0]), n, seed=s, epoch=0)[0] for s in range(seeds)])
    counts = np.bincount(first, minlength=n)
    assert counts.min() > 0.8 * seeds / n and counts.max() < 1.2 * seeds / n
    image = permute(np.arange(100_000), 100_000, seed=1, epoch=0)
    assert np.sum(image == np.arange(100_000)) < 10  # about one fixed point expected
    # Neighbouring positions land far apart: no locality left over from the input.
    assert np.median(np.abs(np.diff(image))) > 20_000


def test_no_memory_proportional_to_n():
    tracemalloc.start()
    try:
        permute(np.arange(4096), 2_000_000_000, seed=0, epoch=9)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # a materialized permutation would be 16 GB


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="size"):
        permute(np.array([0]), 0, seed=0, epoch=0)
    with pytest.raises(IndexError, match=r"\[0, 5\)"):
        permute(np.array([5]), 5, seed=0, epoch=0)
    assert permute(np.array([0]), 1, seed=4, epoch=4).tolist() == [0]
    assert permute(np.array([], dtype=np.int64), 3, seed=0, epoch=0).shape == (0,)
