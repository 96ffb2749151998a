"""DiLoCo across replica groups with real processes: a lighthouse and two groups of one rank on
gloo (docs/fault_tolerance.md, "DiLoCo: groups on a slow link")."""

from __future__ import annotations

import pytest
import torch

from kiln.config import load_config
from kiln.parallel.diloco import fragment_of
from tests.conftest import DEBUG_CONFIG
from tests.distributed.launch import kiln_args, start_ranks, wait_all
from tests.distributed.test_fault_tolerance import WORKER, fault_tolerance
from tests.support.lighthouse import lighthouse

STEPS, SYNC_EVERY = 12, 4


@pytest.mark.parametrize("streaming", [False, True], ids=["diloco", "streaming_f2_delay1"])
def test_groups_hold_the_same_weights_after_each_sync(tmp_path, demo_data, streaming):
    """Plain DiLoCo: after the last sync (step 12) every weight is bitwise the same in both
    groups. Streaming DiLoCo with two fragments, each all-reduce started a step before its
    outer step: a sync every 2 steps, the fragments in turn; step 12's is the sixth, fragment 1
    (the second half of the blocks and the head): its weights are the same, fragment 0's,
    synced at step 10 and trained twice since, are not."""
    run, logs = tmp_path / "run", tmp_path / "logs"
    base = kiln_args(run, demo_data, f"--train.max_steps={STEPS}", "--checkpoint.interval=0")
    diloco = ["--fault_tolerance.sync=diloco", f"--fault_tolerance.sync_every={SYNC_EVERY}"]
    if streaming:
        diloco += ["--fault_tolerance.fragments=2", "--fault_tolerance.fragment_sync_delay=1"]
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
    if not streaming:
        assert all(torch.equal(model_0[k], model_1[k]) for k in model_0)
        return
    names = list(model_0)
    block_of = {name: int(name.split(".")[1]) for name in names if name.startswith("layers.")}
    blocks = load_config(DEBUG_CONFIG).model.n_layers
    fragment = fragment_of(names, block_of=block_of, blocks=blocks, fragments=2)
    assert all(torch.equal(model_0[k], model_1[k]) for k in names if fragment[k] == 1)
    assert not all(torch.equal(model_0[k], model_1[k]) for k in names if fragment[k] == 0)


def test_a_killed_group_rejoins_at_a_sync_and_the_groups_end_equal(tmp_path, demo_data):
    """Group 1 is killed between syncs; group 0 syncs alone; group 1 restarted trains on its own
    until its first sync, heals there from group 0 (weights, optimizer, data position and the
    outer state; its pseudo-gradient weighs 0), and after the last sync both groups hold the
    same weights, bit for bit."""
    import signal
    import time

    from kiln.events import read_events
    from tests.distributed.launch import log
    from tests.distributed.test_fault_tolerance import logged_steps, wait_until

    run, logs, steps = tmp_path / "run", tmp_path / "logs", 80
    base = kiln_args(run, demo_data, f"--train.max_steps={steps}", "--checkpoint.interval=0")
    diloco = ["--fault_tolerance.sync=diloco", f"--fault_tolerance.sync_every={SYNC_EVERY}"]
    with lighthouse(logs / "lighthouse.txt") as house:
        args = [[*base, *fault_tolerance(house.address, g), *diloco] for g in (0, 1)]
        gate = tmp_path / "gate"  # the restarted group waits, imported, until let join
        again = start_ranks(1, [f"--test-gate={gate}", *args[1]], logs / "again", module=WORKER)
        # Another sync interval: refused when it heals, naming the difference.
        wrong_gate, wrong_args = (
            tmp_path / "wrong_gate",
            [*args[1], "--fault_tolerance.sync_every=8"],
        )
        wrong = start_ranks(
            1, [f"--test-gate={wrong_gate}", *wrong_args], logs / "wrong", module=WORKER
        )
        group_0 = start_ranks(1, args[0], logs / "g0", module=WORKER)
        group_1 = start_ranks(1, args[1], logs / "g1", module=WORKER)
        wait_until(lambda: len(logged_steps(run / "replica_group_1")) >= 6, group_1, "6 steps")
        group_1[0].send_signal(signal.SIGKILL)
        died = time.time()
        wait_all(group_1, timeout=10)
        alone = lambda: any(  # noqa: E731
            e["event"] == "quorum" and e["participants"] == 1 and e["time"] > died
            for e in read_events(run / "replica_group_0")
        )
        wait_until(alone, group_0, "group 0 syncing alone")
        wrong_gate.touch()
        assert wait_all(wrong, timeout=120) != [0]
        assert "fault_tolerance.sync_every: 4 -> 8" in log(logs / "wrong")
        gate.touch()
        assert wait_all(group_0 + again, timeout=240) == [0, 0]
    healed = [
        e for e in read_events(run / "replica_group_1") if e["event"] == "quorum" and e["healed"]
    ]
    assert healed, "group 1 did not heal from group 0"
    (model_0,), (model_1,) = (
        [part["model"] for part in torch.load(run / f"replica_group_{g}" / "final_rank_0.pt")]
        for g in (0, 1)
    )
    assert all(torch.equal(model_0[k], model_1[k]) for k in model_0)


def test_a_diloco_run_resumed_reproduces_the_uninterrupted_losses(tmp_path, demo_data):
    """Both groups stop at step 2 (before the first sync, so before the groups ever met), then
    at step 10 (between syncs: each group's checkpoint holds its inner state, the weights of
    the sync at 8 and the outer momentum), and resume to 16: each group's losses are bitwise
    those of the run that did not stop (the same operations on the same values). Step 12's
    outer step uses the momentum the checkpoint carried."""
    import json

    def run(run_dir, *extra: str) -> None:
        base = kiln_args(
            run_dir, demo_data, "--train.max_steps=16", f"--checkpoint.interval={SYNC_EVERY}"
        )
        diloco = ["--fault_tolerance.sync=diloco", f"--fault_tolerance.sync_every={SYNC_EVERY}"]
        with lighthouse(tmp_path / f"lighthouse_{run_dir.name}.txt", min_replicas=2) as house:
            groups = [
                start_ranks(
                    1,
                    [*base, *fault_tolerance(house.address, g), *diloco, *extra],
                    tmp_path / "logs" / f"{run_dir.name}_{g}_{len(extra)}",
                    module=WORKER,
                )
                for g in (0, 1)
            ]
            assert wait_all(groups[0] + groups[1], timeout=240) == [0, 0]

    def losses(run_dir, group: int) -> dict[int, float]:
        lines = (run_dir / f"replica_group_{group}" / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines)}

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run(whole)
    run(resumed, "--train.stop_at_step=2")
    run(resumed, "--train.stop_at_step=10")
    run(resumed)
    for group in (0, 1):
        assert losses(resumed, group) == losses(whole, group), group
