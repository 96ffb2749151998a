"""What the loop does after a step whose loss or gradient norm was not finite on some rank:
the update was skipped; after resilience.nan_max_consecutive in a row, stop or roll back."""

from __future__ import annotations

from kiln.checkpoint.manager import CheckpointManager
from kiln.checkpoint.state import Modules, Optimizers
from kiln.events import EventLog
from kiln.log import warn
from kiln.resilience import NanGuard
from kiln.train.schedule_free import optimizer_train_point
from kiln.train.step import StepResult


def report_skipped(
    guard: NanGuard, result: StepResult, *, step: int, events: EventLog, is_main: bool
) -> None:
    """Warn (rank 0) and record that step `step`'s update was skipped."""
    loss, grad_norm = result.loss.item(), result.grad_norm.item()
    if is_main:
        warn(guard.skipped_message(step, loss=loss, grad_norm=grad_norm))
    events.write("nan_skip", step=step, loss=str(loss), grad_norm=str(grad_norm))


def roll_back(
    checkpoints: CheckpointManager,
    guard: NanGuard,
    *,
    at_step: int,
    model: Modules,
    optimizer: Optimizers,
    is_main: bool,
) -> dict:
    """Back to the newest committed checkpoint; its train state. The data continues."""
    state = checkpoints.rollback(at_step=at_step, model=model, optimizer=optimizer)
    optimizer_train_point(optimizer)
    guard.reset()
    if is_main:
        warn(f"rolled back from step {at_step} to {state['path']}; the data continues")
    return state
