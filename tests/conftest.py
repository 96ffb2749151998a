"""Shared fixtures: the built-in corpus is built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = REPO / "configs" / "train" / "debug.toml"

# The loopback servers (s3_endpoint, s3_env) for the remote-data and object-store tests.
pytest_plugins = ["tests.support.servers"]

# Two cores: keep torch from oversubscribing when tests run subprocesses.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_collection_modifyitems(items) -> None:
    """Mark the tests that run on the gangs of worker processes: `make test` runs them in one
    pytest process over tests/distributed (one set of gangs, every core theirs), then the rest
    on two workers."""
    for item in items:
        if "gangs" in getattr(item, "fixturenames", ()):
            if REPO / "tests" / "distributed" not in item.path.parents:
                raise pytest.UsageError(
                    f"{item.nodeid} uses the gangs: move it to tests/distributed"
                )
            item.add_marker(pytest.mark.gang)


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
