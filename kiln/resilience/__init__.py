from kiln.resilience import exit_codes
from kiln.resilience.nan_guard import NanGuard
from kiln.resilience.preemption import PreemptionFlag, detach_loader_worker
from kiln.resilience.watchdog import StepWatchdog

__all__ = [
    "NanGuard",
    "PreemptionFlag",
    "StepWatchdog",
    "detach_loader_worker",
    "exit_codes",
]
