"""Skip optimizer steps whose loss or gradient norm is not finite; act after too many in a row."""

from __future__ import annotations

from kiln.config.sections import ResilienceConfig


class NanGuard:
    def __init__(self, *, max_consecutive: int, action: str):
        self.max_consecutive = max_consecutive
        self.action = action
        self.consecutive = 0
        self.skipped_total = 0

    @classmethod
    def from_config(cls, cfg: ResilienceConfig) -> NanGuard:
        return cls(max_consecutive=cfg.nan_max_consecutive, action=cfg.nan_action)

    def update(self, *, finite: bool) -> str:
        """'ok' (take the step), 'skip', or the configured action ('stop' or 'rollback') once
        `max_consecutive` steps in a row were not finite."""
        if finite:
            self.consecutive = 0
            return "ok"
        self.consecutive += 1
        self.skipped_total += 1
        if self.consecutive >= self.max_consecutive:
            return self.action
        return "skip"

    def reset(self) -> None:
        self.consecutive = 0

    def skipped_message(self, step: int, *, loss: float, grad_norm: float) -> str:
        return (
            f"step {step}: non-finite loss or gradient norm (loss {loss}, grad_norm {grad_norm}); "
            f"the update was skipped ({self.consecutive} in a row, "
            f"resilience.nan_max_consecutive = {self.max_consecutive})"
        )

    def stop_message(self, step: int, *, newest: object) -> str:
        return (
            f"{self.consecutive} steps in a row up to step {step} had a non-finite loss or "
            f"gradient norm; stopping. The newest checkpoint is {newest or '(none)'}. Lower "
            "optimizer.lr or train.grad_clip_norm, check the data, or set "
            "resilience.nan_action = 'rollback'"
        )
