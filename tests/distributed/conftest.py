"""Reference runs shared by the parity suites: one process per model variant, computed on first use."""

import pytest

from tests.distributed.parity import GLOBAL_BATCH, records, train


@pytest.fixture(scope="session")
def references(tmp_path_factory, demo_data):
    """One-process runs, one per model variant, computed on first use."""
    cache = {}

    def get(*model_overrides):
        if model_overrides not in cache:
            base = tmp_path_factory.mktemp("reference")
            overrides = [f"--train.batch_size={GLOBAL_BATCH}", *model_overrides]
            cache[model_overrides] = records(train(base, "one", demo_data, 1, *overrides))
        return cache[model_overrides]

    return get


@pytest.fixture(scope="session")
def reference(references):
    return references()
