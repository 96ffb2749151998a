"""Replica groups with torchft (docs/fault_tolerance.md), with real processes: a lighthouse, and
each group a job of its own ranks on gloo. A group killed with SIGKILL is dropped while the
other trains on; restarted, it takes the live group's state and the run completes; a run with
no failure matches plain HSDP; a lost lighthouse stops every group with its message."""

from __future__ import annotations

import itertools
import json
import signal
import time
from pathlib import Path

import torch

from kiln.events import read_events
from tests.distributed.launch import kiln_args, log, start_ranks, wait_all
from tests.distributed.parity import assert_parity, records, train_args
from tests.support.lighthouse import lighthouse

WORKER = "tests.distributed.replica_group_kiln"
# A step waits this long for its quorum; the survivors' wait for a dead group is bounded by the
# lighthouse's heartbeat timeout, far below it.
QUORUM_TIMEOUT_S = 10


def fault_tolerance(address: str, group: int, *extra: str) -> list[str]:
    return [
        "--distributed.dp_replicate=2",
        "--fault_tolerance.enabled=true",
        f"--fault_tolerance.lighthouse={address}",
        f"--fault_tolerance.replica_group={group}",
        f"--fault_tolerance.quorum_timeout_s={QUORUM_TIMEOUT_S}",
        "--fault_tolerance.timeout_s=20",
        *extra,
    ]


def group_events(run_dir: Path, group: int, event: str) -> list[dict]:
    return [e for e in read_events(run_dir / f"replica_group_{group}") if e["event"] == event]


def wait_until(condition, procs, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        finished = [p.args for p in procs if p.poll() is not None]
        assert not finished, f"a rank ended while waiting for {what}"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line)["step"] for line in lines]


def test_a_killed_group_is_dropped_then_rejoins_from_the_live_one(tmp_path, demo_data):
    run, logs, steps = tmp_path / "run", tmp_path / "logs", 50
    # No checkpoints: a restarted group can only take its state from the live one.
    base = kiln_args(run, demo_data, f"--train.max_steps={steps}", "--checkpoint.interval=0")
    base += ["--distributed.dp_shard=2"]
    with lighthouse(logs / "lighthouse.txt") as house:
        args = [[*base, *fault_tolerance(house.address, g)] for g in (0, 1)]
        gates = {name: tmp_path / f"gate_{name}" for name in ("first", "wrong", "again")}
        # Group 1's three lives start now and wait at their gates: each joins at once when let.
        # Group 1's first life dies in the backward of its third step, while its gradients
        # cross the groups: the step must commit nowhere.
        stall = tmp_path / "stalled"
        group_1, wrong, again = (
            start_ranks(2, [f"--test-gate={gates[name]}", *a], logs / name, module=WORKER)
            for name, a in (
                ("first", [f"--test-stall-backward=3:{stall}", *args[1]]),
                # Another learning rate: a live group's state is refused by the group's check.
                ("wrong", [*args[1], "--optimizer.lr=0.5"]),
                ("again", args[1]),
            )
        )
        group_0 = start_ranks(2, args[0], logs / "group_0", module=WORKER)
        # Group 0 first: it trains every step from 1, and group 1 joins it (healing once).
        wait_until(lambda: logged_steps(run / "replica_group_0"), group_0, "a step of group 0")
        gates["first"].touch()
        both_in = lambda: any(e["participants"] == 2 for e in group_events(run, 1, "quorum"))  # noqa: E731
        wait_until(both_in, group_0 + group_1, "both groups in one quorum")
        stalled = lambda: all(Path(f"{stall}.rank_{r}").exists() for r in (0, 1))  # noqa: E731
        wait_until(stalled, group_1, "group 1 in the backward of its third step")
        killed_at = logged_steps(run / "replica_group_1")[-1] + 1
        for proc in group_1:  # the whole group, as when its node fails
            proc.send_signal(signal.SIGKILL)
        died = time.time()
        wait_all(group_1, timeout=10)
        alone = lambda: [  # noqa: E731
            e for e in group_events(run, 0, "quorum") if e["participants"] == 1 and e["time"] > died
        ]
        wait_until(alone, group_0, "group 0 alone in a quorum")
        # The survivors did not wait for the quorum timeout: their failed step and the
        # lighthouse's missed heartbeats (its 1 s timeout) took about 5 s here
        # (benchmarks/fault_tolerance.md), bounded by the quorum timeout on a loaded machine.
        assert alone()[0]["time"] - died < QUORUM_TIMEOUT_S

        gates["wrong"].touch()
        assert wait_all(wrong, timeout=120) != [0, 0]
        assert "replica group 1 cannot rejoin" in log(logs / "wrong")
        assert "optimizer.lr: 0.003 -> 0.5" in log(logs / "wrong")
        gates["again"].touch()
        assert wait_all(group_0 + again, timeout=240) == [0] * 4
    healed = [e for e in group_events(run, 1, "quorum") if e["healed"]]
    assert healed[-1]["step"] > killed_at  # from the live group: there is no checkpoint
    # The survivor's step that lost its peer in the backward was not committed.
    assert killed_at in [e["step"] for e in group_events(run, 0, "not_committed")]
    # The console says it: the survivor once per group lost (the killed one, the refused one),
    # with the global batch it trains on (8 sequences a group), and the healed group whence.
    survivor = log(logs / "group_0")
    sizes = [e["participants"] for e in group_events(run, 0, "quorum")]
    drops = sum(b < a for a, b in itertools.pairwise(sizes))
    assert survivor.count("replica group 0: group 1 left at step") == drops >= 1
    assert (
        "this group trains on with 1 of 2 groups: global batch 8 sequences (16 with every "
        "group) until group 1 rejoins"
    ) in survivor
    joins = sum(b > a for a, b in itertools.pairwise(sizes))
    assert survivor.count("replica group 0: group 1 joined at step") == joins >= 2
    step = healed[-1]["step"]
    assert f"replica group 1 joined at step {step} from group 0" in log(logs / "again")
    assert f"starts from replica group 0's state at step {step - 1}" in log(logs / "again")
    # Every step of the run trained once in group 0, the dead group's failed step included
    # (it was not committed, and redone on the next batch).
    assert logged_steps(run / "replica_group_0") == list(range(1, steps + 1))
    assert logged_steps(run / "replica_group_1")[-1] == steps
    # The global batch shrinks to the live groups' while one is out (its samples are skipped).
    seen = [r["tokens_seen"] for r in records(run / "replica_group_0").values()]
    per_step = {b - a for a, b in itertools.pairwise(seen)}
    assert per_step == {min(per_step), 2 * min(per_step)}, per_step
    for rank in (0, 1):  # the same shards, bitwise: the same arithmetic on the same values
        live = torch.load(run / "replica_group_0" / f"final_rank_{rank}.pt")
        healed_shards = torch.load(run / "replica_group_1" / f"final_rank_{rank}.pt")
        for part_live, part_healed in zip(live, healed_shards, strict=True):
            for kind in ("model", "optim"):
                for key, value in part_live[kind].items():
                    other = part_healed[kind][key]
                    assert torch.equal(value, other) if torch.is_tensor(value) else value == other


def test_a_run_without_failures_matches_plain_hsdp(tmp_path, demo_data, runs):
    """Two groups × dp_shard=2 against the parity suite's dp_replicate=2 × dp_shard=2 run:
    within the parity band (fp32, the same sums in another reduction order: the loss is summed
    over the groups in the quorum's process group). Each FSDP unit's gradients cross the groups
    during the backward, as soon as the unit's own backward is done, not after the whole."""
    layout = ["--distributed.dp_replicate=2", "--distributed.dp_shard=2", "--train.batch_size=2"]
    run, logs = tmp_path / "run", tmp_path / "logs"
    with lighthouse(logs / "lighthouse.txt", min_replicas=2) as house:  # both from step 1
        groups = [
            start_ranks(
                2,
                [
                    "--test-order",
                    *train_args(run, demo_data, *layout, *fault_tolerance(house.address, g)),
                ],
                logs / f"group_{g}",
                module=WORKER,
            )
            for g in (0, 1)
        ]
        assert wait_all(groups[0] + groups[1], timeout=240) == [0] * 4
    hsdp = records(runs(4, *layout))
    for group in (0, 1):
        assert_parity(records(run / f"replica_group_{group}"), hsdp)
        for rank in (0, 1):
            order = json.loads(
                (run / f"replica_group_{group}" / f"order_rank_{rank}.json").read_text()
            )
            # The valid-token count before the forward; then per unit, its backward and its
            # gradients' sum, the next unit's backward running after; the loss after the last.
            units = order.count("backward")
            assert units >= 3, order  # the debug model: two blocks and the root
            assert order == [
                "all_reduce",
                *["backward", "all_reduce"] * units,
                "all_reduce",
                "commit",
            ]


def test_a_signal_to_one_group_stops_all_then_a_lost_lighthouse_stops_all(tmp_path, demo_data):
    """SIGTERM to one group stops every group at the same step, with the writer's checkpoint;
    started again, the groups resume from it. Then the documented rule for a lost lighthouse:
    no quorum, no step; each group stops at its next step, within the quorum timeout, naming
    the lighthouse."""
    run, logs = tmp_path / "run", tmp_path / "logs"
    base = kiln_args(run, demo_data, "--train.max_steps=200", "--checkpoint.interval=0")
    with lighthouse(logs / "lighthouse.txt") as house:

        def start(name: str) -> list:
            return [
                start_ranks(1, [*base, *fault_tolerance(house.address, g)], logs / f"{name}_{g}")
                for g in (0, 1)
            ]

        groups = start("first")
        everyone = groups[0] + groups[1]
        both_in = lambda: any(e["participants"] == 2 for e in group_events(run, 1, "quorum"))  # noqa: E731
        wait_until(both_in, everyone, "both groups in one quorum")
        groups[1][0].send_signal(signal.SIGTERM)
        assert wait_all(everyone, timeout=120) == [75, 75]  # stopped after a checkpoint
        stops = [group_events(run, g, "stop")[-1]["step"] for g in (0, 1)]
        assert stops[0] == stops[1]

        restarted = time.time()
        groups = start("again")
        everyone = groups[0] + groups[1]
        together = lambda: any(  # noqa: E731
            e["participants"] == 2 and e["time"] > restarted
            for g in (0, 1)
            for e in group_events(run, g, "quorum")
        )
        wait_until(together, everyone, "both groups in one quorum after the restart")
        house.kill()
        lost = time.monotonic()
        codes = wait_all(everyone, timeout=QUORUM_TIMEOUT_S + 30)
    assert time.monotonic() - lost < QUORUM_TIMEOUT_S + 20  # one quorum timeout, and the exit
    assert codes == [2, 2]  # kiln train's exit code for an error it explains
    # The first group back reads the checkpoint; the other one too, or heals from it.
    checkpoint = run / "checkpoints" / f"step_{stops[0]:08d}"
    assert any(f"resumed from {checkpoint}" in log(logs / f"again_{g}") for g in (0, 1))
    for group in (0, 1):
        output = log(logs / f"again_{group}")
        assert f"replica group {group}: no quorum for step" in output
        assert f"Is the lighthouse at {house.address} still running?" in output
