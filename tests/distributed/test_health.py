"""The start-up health check and the flight recorder on real ranks (stock gloo, started by hand):
a rank held back before the check is named, a rank that never arrives stops the job naming it, and
a rank hung in a step is named by the dump and summary the watchdogs write."""

from __future__ import annotations

import json
import socket

from tests.distributed.launch import kiln_args, log, start_ranks, wait_all

HOST = socket.gethostname()
HUNG = 124
WORKER = "tests.distributed.held_back_kiln"
# One step without warm-up: these tests are about start-up and the ranks, not training.
SHORT = ["--train.max_steps=1", "--scheduler.warmup_steps=0", "--train.batch_size=1"]


def test_a_rank_late_to_the_health_check_is_named_and_the_job_trains(
    tmp_path, demo_data, monkeypatch
):
    # Rank 1 sleeps 3 s before its first all-reduce; 1 s is the threshold: 2 s of margin for
    # the skew two busy cores add, which is well under a second.
    monkeypatch.setenv("HELD_BACK_DELAY", "1:3")
    run = tmp_path / "run"
    args = kiln_args(run, demo_data, *SHORT, "--resilience.preflight_slow_s=1")
    procs = start_ranks(2, args, tmp_path / "logs", module=WORKER)
    assert wait_all(procs, 120) == [0, 0], log(tmp_path / "logs")
    named = f"health check: rank 1 ({HOST}): the others waited"
    assert named in log(tmp_path / "logs", 0)
    assert "rank 0 (" not in log(tmp_path / "logs", 0)  # the waiting rank is not the late one
    (event,) = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()[:1]]
    assert event["event"] == "preflight" and event["slow"][0].startswith(f"rank 1 ({HOST})")


def test_a_rank_that_never_reaches_the_health_check_stops_the_job_naming_it(
    tmp_path, demo_data, monkeypatch
):
    # Rank 1 arrives 5 s late; rank 0 gives up after 2 s (resilience.preflight_timeout_s).
    monkeypatch.setenv("HELD_BACK_DELAY", "1:5")
    args = kiln_args(tmp_path / "run", demo_data, *SHORT, "--resilience.preflight_timeout_s=2")
    procs = start_ranks(2, args, tmp_path / "logs", module=WORKER)
    codes = wait_all(procs, 120)
    assert codes[0] == 2 and codes[1] != 0, log(tmp_path / "logs")
    rank_0 = log(tmp_path / "logs", 0)
    assert (
        "the health check's all-reduce over the world failed or did not complete within 2 s"
        in rank_0
    )
    assert f"rank 1 ({HOST}) never entered it (last seen in the start of the check)" in rank_0
    assert "Traceback" not in rank_0


def test_a_rank_hung_in_a_step_is_named_by_the_flight_recorder(tmp_path, demo_data, monkeypatch):
    # Rank 1 sleeps for good at the start of step 3; the watchdogs (armed from step 2) end both
    # ranks 4 s into it: a debug step takes a fraction of a second even on two busy cores.
    monkeypatch.setenv("HELD_BACK_HANG", "1:3")
    run = tmp_path / "run"
    overrides = ["--train.max_steps=6", "--train.batch_size=1", "--resilience.step_timeout_s=4"]
    procs = start_ranks(2, kiln_args(run, demo_data, *overrides), tmp_path / "logs", module=WORKER)
    assert wait_all(procs, 120) == [HUNG, HUNG], log(tmp_path / "logs")
    folder = run / "flight_recorder"
    dumps = {r: json.loads((folder / f"rank_{r}.json").read_text()) for r in (0, 1)}
    assert dumps[0]["attempt"] == dumps[1]["attempt"]
    assert dumps[1]["reason"] == "step 3 ran past resilience.step_timeout_s"
    summary = (folder / "summary.txt").read_text()
    first = summary.splitlines()[0]
    assert first.startswith(f"rank 1 ({HOST}) never entered "), summary
    assert first.endswith("rank 0 waited in it"), summary
    # Every rank that dumped printed the summary; rank 0's saw rank 1's dump too.
    assert f"rank 1 ({HOST}) never entered " in log(tmp_path / "logs", 0)
