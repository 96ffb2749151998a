"""Expert parallel: the all-to-all dispatcher (exact against the local one) and the layouts'
parity with one process (DESIGN §5)."""

import pytest

from tests.distributed.expert_dispatch_worker import check_dispatch


@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("capacity", [0.0, 1.0])
def test_all_to_all_dispatch_equals_local_dispatch(nproc, capacity, gangs):
    gangs.run(nproc, check_dispatch, capacity)
