from kiln.resilience import exit_codes
from kiln.resilience.nan_guard import NanGuard
from kiln.resilience.preemption import PreemptionFlag
from kiln.resilience.watchdog import StepWatchdog

__all__ = [
    "NanGuard",
    "PreemptionFlag",
    "StepWatchdog",
    "exit_codes",
]
