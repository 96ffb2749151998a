"""Kept only while kiln/checkpoint/saver.py (being rewritten) still reads its delay switch here;
every other mutation is installed by the tests from the outside (tests/support/mutations.py).
Delete this module once nothing imports it."""

from __future__ import annotations

import os
import sys

MUTATIONS = {
    "KILN_TEST_DELAY_COMMIT": (
        "rank 0 commits each checkpoint 3 s late and the other ranks wait until their part of a "
        "background save is written"
    ),
}


def mutation_on(name: str) -> bool:
    """Whether the test-only switch `name` is set to "1"; if so, warn."""
    if name not in MUTATIONS:
        raise KeyError(f"unknown test switch {name}; known: {', '.join(MUTATIONS)}")
    on = os.environ.get(name) == "1"
    if on:
        print(
            f"kiln: WARNING: test switch {name} is set: {MUTATIONS[name]}",
            file=sys.stderr,
            flush=True,
        )
    return on
