"""The step watchdog and the NaN guard on their own."""

import subprocess
import sys

from kiln.resilience import NanGuard, exit_codes

HANGING_STEP = """
import time
from kiln.resilience import StepWatchdog
watchdog = StepWatchdog(0.5, rank=3)
watchdog.arm(1)
watchdog.disarm()  # a step that ends in time
watchdog.arm(2)
def stuck_in_a_collective():
    time.sleep(30)
stuck_in_a_collective()
"""


def test_a_step_past_its_bound_dumps_the_stacks_and_exits():
    result = subprocess.run(
        [sys.executable, "-c", HANGING_STEP], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == exit_codes.HUNG
    assert "rank 3: step 2 has run for more than 0.5 s" in result.stderr
    assert "stuck_in_a_collective" in result.stderr  # the main thread's stack


def test_a_watchdog_that_is_never_late_stays_quiet():
    from kiln.resilience import StepWatchdog

    watchdog = StepWatchdog(5, rank=0)
    for step in range(100):
        watchdog.arm(step)
        watchdog.disarm()
    watchdog.close()


def test_nan_guard_counts_only_steps_in_a_row():
    guard = NanGuard(max_consecutive=2, action="rollback")
    assert [guard.update(finite=f) for f in (False, True, False, False)] == [
        "skip",
        "ok",
        "skip",
        "rollback",
    ]
    assert guard.skipped_total == 3
