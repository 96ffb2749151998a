"""Bad input under [fault_tolerance] (docs/fault_tolerance.md): one clear message each, before
anything trains; and a group that cannot commit gives up with the reason, not a hang. The
multi-process behaviour is in tests/distributed/test_fault_tolerance.py."""

from __future__ import annotations

import re

import pytest

from kiln.config import load_config
from kiln.errors import ConfigError, KilnError
from kiln.train.trainer import Trainer
from tests.conftest import DEBUG_CONFIG
from tests.distributed.launch import free_port
from tests.support.lighthouse import lighthouse


def ft(*extra: str, groups: int = 2) -> list[str]:
    return [
        f"--distributed.dp_replicate={groups}",
        "--fault_tolerance.enabled=true",
        "--fault_tolerance.connect_timeout_s=2",
        *extra,
    ]


def problems(*overrides: str, launched: int = 1) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(DEBUG_CONFIG, list(overrides), launched=launched)
    return str(caught.value)


def test_one_replica_group_is_refused_with_the_reason():
    message = problems(*ft(groups=1))
    assert "fault_tolerance.enabled needs distributed.dp_replicate >= 2" in message
    assert "there is no other group to train on" in message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("--fault_tolerance.replica_group=2", "replica_group = 2 is not one of the 2 groups"),
        ("--fault_tolerance.min_replicas=3", "min_replicas must be between 1 and"),
        ("--fault_tolerance.quorum_timeout_s=0", "quorum_timeout_s must be > 0"),
        ("--fault_tolerance.max_failed_steps=0", "max_failed_steps must be >= 1"),
        ("--data.streaming=true", "reads prepared (or tokenized) datasets only"),
        ("--checkpoint.async_mode=async", "saves checkpoints synchronously only"),
        ("--resilience.nan_action=rollback", "rolling back to a checkpoint is not supported"),
    ],
)
def test_each_bad_setting_has_its_message(override, expected):
    assert expected in problems(*ft(override))


def test_the_launched_processes_are_one_groups():
    """torchrun launches one replica group: 2 processes of dp_shard=2 in each of 2 groups."""
    load_config(DEBUG_CONFIG, ft("--distributed.dp_shard=2"), launched=2)
    assert "the world size is 8" in problems(*ft("--distributed.dp_shard=2"), launched=4)


def test_no_lighthouse_configured(debug_overrides, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    cfg = load_config(DEBUG_CONFIG, [*debug_overrides, *ft()], launched=1)
    with pytest.raises(ConfigError, match=re.escape("fault_tolerance.enabled needs a lighthouse")):
        Trainer(cfg)


def test_an_unreachable_lighthouse(debug_overrides):
    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = load_config(
        DEBUG_CONFIG, [*debug_overrides, *ft(f"--fault_tolerance.lighthouse={address}")], launched=1
    )
    with pytest.raises(KilnError, match=re.escape(f"no lighthouse answers at {address}")):
        Trainer(cfg)


def test_a_group_that_cannot_commit_gives_up_with_the_reason(debug_overrides, tmp_path):
    """Two groups needed to commit (fault_tolerance.min_replicas), one alive: every step fails
    to commit, and after max_failed_steps the group stops saying why."""
    with lighthouse(tmp_path / "lighthouse.txt") as house:
        overrides = ft(
            f"--fault_tolerance.lighthouse={house.address}",
            "--fault_tolerance.min_replicas=2",
            "--fault_tolerance.max_failed_steps=2",
            "--train.max_steps=10",
        )
        trainer = Trainer(load_config(DEBUG_CONFIG, [*debug_overrides, *overrides], launched=1))
        with pytest.raises(KilnError) as caught:
            trainer.train()
    assert "replica group 0 gives up: 2 steps in a row could not commit" in str(caught.value)
    assert "too few groups" in str(caught.value)
    assert trainer.step == 0  # nothing was committed, so nothing counted


def test_kiln_check_takes_one_groups_processes(capsys):
    """As torchrun's WORLD_SIZE under fault tolerance, --world-size is one group's."""
    from kiln.cli import main

    assert main(["check", str(DEBUG_CONFIG), "--world-size=1", "--config-only", *ft()]) == 0
    assert "world size 2: dp_replicate=2 × dp_shard=1" in capsys.readouterr().out
