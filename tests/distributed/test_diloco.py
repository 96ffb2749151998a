"""DiLoCo across replica groups with real processes: a lighthouse and two groups of one rank on
gloo. WORK IN PROGRESS (branch wip/diloco)."""

from __future__ import annotations

import torch

from tests.distributed.launch import kiln_args, start_ranks, wait_all
from tests.distributed.test_fault_tolerance import WORKER, fault_tolerance
from tests.support.lighthouse import lighthouse

STEPS, SYNC_EVERY = 12, 4


def test_groups_hold_the_same_weights_after_each_sync(tmp_path, demo_data):
    run, logs = tmp_path / "run", tmp_path / "logs"
    base = kiln_args(run, demo_data, f"--train.max_steps={STEPS}", "--checkpoint.interval=0")
    diloco = ["--fault_tolerance.sync=diloco", f"--fault_tolerance.sync_every={SYNC_EVERY}"]
    with lighthouse(logs / "lighthouse.txt", min_replicas=2) as house:
        groups = [
            start_ranks(
                1,
                [*base, *fault_tolerance(house.address, g), *diloco],
                logs / f"g{g}",
                module=WORKER,
            )
            for g in (0, 1)
        ]
        assert wait_all(groups[0] + groups[1], timeout=240) == [0, 0]
    (model_0,), (model_1,) = (
        [part["model"] for part in torch.load(run / f"replica_group_{g}" / "final_rank_0.pt")]
        for g in (0, 1)
    )
    assert model_0.keys() == model_1.keys()
    assert all(torch.equal(model_0[k], model_1[k]) for k in model_0)
