"""A seeded random permutation of [0, n), evaluated one index at a time.

The loader shuffles every epoch. Materializing `rng.permutation(n)` costs O(n) time and memory per
epoch in every worker process: 16 GB and minutes for 2e9 samples. Here the permutation is
a keyed Feistel network instead, so the dataset index of any position is computed on its own in
O(1) memory, and the order stays a pure function of (seed, epoch, position), whatever the layout
of ranks and workers that asks for it.

The network permutes the 2^bits values with 2^bits >= n > 2^(bits-1), as two halves of bits // 2
and bits - bits // 2 bits (unbalanced for odd bits; each round swaps them, an even number of
rounds brings them back). Every round is invertible whatever its round function, so the network
is a bijection; an output >= n is fed through again ("cycle walking") until it lands below n,
which keeps the map a bijection of [0, n) and takes fewer than 2 passes on average.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: odd, so successive keys never repeat
ROUNDS = 8  # even, so the halves end at their starting widths; 4 already mix well
MAX_SIZE = 1 << 62
# Below this many values numpy's per-call overhead outweighs its vector speed: walk them as ints.
SCALAR_BELOW = 64


def permute(positions: np.ndarray, n: int, *, seed: int, epoch: int) -> np.ndarray:
    """Where positions (each in [0, n)) go under the permutation of [0, n) keyed by (seed, epoch),
    as an int64 array of the same shape. Different seeds or epochs give unrelated orders."""
    if not 1 <= n <= MAX_SIZE:
        raise ValueError(f"permutation size must be in [1, 2**62], got {n}")
    x = np.asarray(positions, dtype=np.int64)
    if x.size and (x.min() < 0 or x.max() >= n):
        raise IndexError(f"positions must lie in [0, {n})")
    keys, bits = _round_keys(seed, epoch), (n - 1).bit_length()
    flat = x.reshape(-1).astype(np.uint64)
    pending = np.arange(flat.size)
    while len(pending) >= SCALAR_BELOW:
        flat[pending] = _feistel(flat[pending], bits, keys)
        pending = pending[flat[pending] >= np.uint64(n)]
    for i in pending.tolist():
        flat[i] = _walk(int(flat[i]), n, bits, keys)
    return flat.astype(np.int64).reshape(x.shape)


def _walk(value: int, n: int, bits: int, keys: list[int]) -> int:
    """Cycle walking on one value: through the network until it lands in [0, n)."""
    value = _feistel(value, bits, keys)
    while value >= n:
        value = _feistel(value, bits, keys)
    return value


def _round_keys(seed: int, epoch: int) -> list[int]:
    """One 64-bit key per round, from a splitmix64 sequence started at hash(seed, epoch)."""
    state = _mix(_mix(seed & MASK) ^ (epoch & MASK))
    return [_mix((state + (r + 1) * GOLDEN) & MASK) for r in range(ROUNDS)]


def _mix(z: Any) -> Any:
    """splitmix64's finalizer, a bijection of 64-bit values with full avalanche, on a Python int
    or a uint64 array (the mask keeps Python ints to 64 bits; numpy wraps by itself)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _feistel(x: Any, bits: int, keys: list[int]) -> Any:
    """One pass of the network over values of `bits` bits (a Python int or a uint64 array):
    (left, right) -> (right, left ^ F(right)) per round, undone by recomputing F from the half
    it kept, so a bijection whatever F is."""
    left_bits, right_bits = bits // 2, bits - bits // 2
    left, right = x >> right_bits, x & ((1 << right_bits) - 1)
    for key in keys:
        mixed = _mix(right ^ key) & ((1 << left_bits) - 1)
        left, right = right, left ^ mixed
        left_bits, right_bits = right_bits, left_bits
    return (left << right_bits) | right
