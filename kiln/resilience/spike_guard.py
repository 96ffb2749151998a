"""Loss-spike skipping (`resilience.spike_action = "skip"`): a step whose loss or gradient norm
stands more than `spike_sigmas` standard deviations above the mean of the last `spike_window`
applied steps is not applied. The history holds applied steps only, is a function of the logged
values (every rank computes the same), and travels in the checkpoint, so a resume decides alike.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from kiln.config.sections import ResilienceConfig

METRICS = ("loss", "grad_norm")


@dataclass(frozen=True)
class Crossed:
    """One threshold a step crossed: the value, the window's mean and standard deviation."""

    metric: str
    value: float
    mean: float
    std: float
    sigmas: float  # the threshold, in standard deviations


class SpikeGuard:
    """The recent history of applied steps, and the spikes skipped (in a row, in all)."""

    def __init__(self, cfg: ResilienceConfig):
        self.window, self.max_consecutive = cfg.spike_window, cfg.spike_max_consecutive
        self.sigmas = {"loss": cfg.spike_loss_sigmas, "grad_norm": cfg.spike_grad_norm_sigmas}
        self.history: deque[tuple[float, float]] = deque(maxlen=self.window)
        self.consecutive = self.skipped_total = 0

    def crossed(self, loss: float, grad_norm: float) -> list[Crossed]:
        """The thresholds this step's values cross; none until the window is full."""
        if len(self.history) < self.window:
            return []
        out = []
        for index, (metric, value) in enumerate(zip(METRICS, (loss, grad_norm), strict=True)):
            past = [entry[index] for entry in self.history]
            # Correctly rounded sums (fsum): the same on every rank and machine, in any order.
            mean = math.fsum(past) / len(past)
            std = math.sqrt(math.fsum((x - mean) ** 2 for x in past) / len(past))
            if value > mean + self.sigmas[metric] * std:
                out.append(Crossed(metric, value, mean, std, self.sigmas[metric]))
        return out

    def record(self, loss: float, grad_norm: float, *, skipped: bool) -> bool:
        """After the step: an applied step joins the history; a skipped one counts. Whether
        `spike_max_consecutive` spikes came in a row."""
        if not skipped:
            self.history.append((loss, grad_norm))
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.skipped_total += 1
        return self.consecutive >= self.max_consecutive

    def skipped_message(self, step: int, crossed: tuple[Crossed, ...]) -> str:
        above = "; ".join(
            f"{c.metric} {c.value:.6g} > mean {c.mean:.6g} + {c.sigmas:g} × std {c.std:.3g}"
            for c in crossed
        )
        above = above or "on another rank"  # every rank holds the same values, barring a fault
        return (
            f"step {step}: loss spike ({above} over the last {self.window} applied steps); the "
            f"update was skipped ({self.consecutive} in a row, resilience.spike_max_consecutive "
            f"= {self.max_consecutive})"
        )

    def stop_message(self, step: int, *, newest: object) -> str:
        return (
            f"{self.consecutive} steps in a row up to step {step} were loss spikes; stopping. The "
            f"newest checkpoint is {newest or '(none)'}. The loss may have moved for good (raise "
            "resilience.spike_loss_sigmas or spike_max_consecutive), or lower optimizer.lr, "
            "check the data, or set resilience.nan_action = 'rollback'"
        )

    def state_dict(self) -> dict:
        return {
            "history": [list(entry) for entry in self.history],
            "consecutive": self.consecutive,
            "skipped_total": self.skipped_total,
        }

    def load_state_dict(self, state: dict) -> None:
        self.history = deque((tuple(e) for e in state["history"]), maxlen=self.window)
        self.consecutive, self.skipped_total = state["consecutive"], state["skipped_total"]
