"""How a training run stops: it commits the save in flight, records why in the event log, and
when it stopped before train.max_steps tells the user how to go on."""

from __future__ import annotations

from collections.abc import Callable

from kiln.checkpoint.manager import CheckpointManager
from kiln.events import EventLog
from kiln.log import warn
from kiln.resilience.preemption import Preempted


class RunEnd:
    """The stops of one run; `save` checkpoints the step the run is at."""

    def __init__(
        self,
        checkpoints: CheckpointManager,
        events: EventLog,
        *,
        save: Callable[[], None],
        max_steps: int,
        is_main: bool,
    ):
        self.checkpoints, self.events, self.save = checkpoints, events, save
        self.max_steps, self.is_main = max_steps, is_main

    def close(self, step: int, reason: str) -> None:
        """Commit the save in flight, then record why and where the run stops."""
        self.checkpoints.close(after_step=step)
        self.events.write("stop", step=step, reason=reason)

    def with_checkpoint(self, step: int, reason: str, how: str) -> None:
        """Stopped early on purpose (`reason`): checkpoint, say how to continue (`how`), close."""
        if not self.checkpoints.is_saved(step):
            self.save()
        if self.is_main:
            warn(
                f"stopped after step {step} of {self.max_steps} ({reason}); run the same "
                f"command {how} from {self.checkpoints.dir}"
            )
        self.close(step, reason)

    def preempted(self, step: int, signal_name: str | None) -> Preempted:
        """Signalled (here or on another rank): checkpoint, close; the error to raise."""
        if not self.checkpoints.is_saved(step):
            self.save()
        signal_name = signal_name or "a signal on another rank"
        self.close(step, f"signal: {signal_name}")
        return Preempted(signal_name=signal_name, step=step, checkpoint=self.checkpoints.newest())
