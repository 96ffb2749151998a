"""Shared fixtures: the built-in corpus is built once per test session.

`make test` runs the suite in two pytest-xdist workers (`-n 2 --dist loadgroup`): every test that
uses the gangs of worker processes (tests/distributed/workers.py) runs in one of them, so the
gangs start once and the one-process reference runs are trained once; the other worker takes the
tests that start their own processes (torchrun, `kiln verify`, the CLI) or run in-process, which
wait on launches, signals and timeouts while the gangs keep both cores busy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = REPO / "configs" / "train" / "debug.toml"

# Two cores: keep torch from oversubscribing when tests run subprocesses.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_itemcollected(item: pytest.Item) -> None:
    # Marked as each test is collected: xdist reads the groups when collection is modified.
    if "gangs" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.xdist_group("gangs"))


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    from kiln.data.demo_corpus import ensure_demo_corpus

    return ensure_demo_corpus(tmp_path_factory.mktemp("corpus") / "demo", max_bytes=2_000_000)


@pytest.fixture
def debug_overrides(demo_data, tmp_path) -> list[str]:
    """Overrides that point the debug recipe at the session corpus and a fresh run dir."""
    return [
        f"--data.path={demo_data}",
        f"--metrics.run_dir={tmp_path / 'run'}",
        "--data.num_workers=0",
    ]
