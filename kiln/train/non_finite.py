"""What the loop does after a step whose update was skipped, its loss or gradient norm not
finite on some rank or a spike (resilience.spike_action): report it; after
resilience.nan_max_consecutive (spike_max_consecutive) in a row, stop or roll back."""

from __future__ import annotations

from dataclasses import asdict

from kiln.checkpoint.manager import CheckpointManager
from kiln.checkpoint.state import Modules, Optimizers
from kiln.events import EventLog
from kiln.log import warn
from kiln.resilience import NanGuard
from kiln.resilience.spike_guard import SpikeGuard
from kiln.train.schedule_free import optimizer_train_point
from kiln.train.step import StepResult


def report_skipped(
    nan_guard: NanGuard,
    spikes: SpikeGuard | None,
    result: StepResult,
    *,
    step: int,
    events: EventLog,
    is_main: bool,
) -> NanGuard | SpikeGuard:
    """Warn (rank 0) and record that step `step`'s update was skipped, as not finite or as a
    loss spike; the guard that counted it (whose stop message applies)."""
    if result.spike:
        if is_main:
            warn(spikes.skipped_message(step, result.crossed))
        crossed = [asdict(c) for c in result.crossed]
        events.write("spike_skip", step=step, crossed=crossed, in_a_row=spikes.consecutive)
        return spikes
    loss, grad_norm = result.loss.item(), result.grad_norm.item()
    if is_main:
        warn(nan_guard.skipped_message(step, loss=loss, grad_norm=grad_norm))
    events.write("nan_skip", step=step, loss=str(loss), grad_norm=str(grad_norm))
    return nan_guard


def skip_action(nan_guard: NanGuard, result: StepResult, *, after: str) -> str:
    """'ok', 'skip', or what comes after too many skipped steps in a row: the NaN guard's
    action, or `after` when spikes reached resilience.spike_max_consecutive."""
    action = nan_guard.update(finite=result.finite)
    if action == "ok" and result.spike:
        return after if result.spike_limit else "skip"
    return action


def roll_back(
    checkpoints: CheckpointManager,
    guard: NanGuard,
    *,
    at_step: int,
    model: Modules,
    optimizer: Optimizers,
    is_main: bool,
    spikes: SpikeGuard | None,
) -> dict:
    """Back to the newest committed checkpoint; its train state. The data continues, and the
    spike history is the checkpoint's."""
    state = checkpoints.rollback(at_step=at_step, model=model, optimizer=optimizer)
    optimizer_train_point(optimizer)
    guard.reset()
    if spikes is not None and "spike_guard" in state:
        spikes.load_state_dict(state["spike_guard"])
    if is_main:
        warn(f"rolled back from step {at_step} to {state['path']}; the data continues")
    return state
