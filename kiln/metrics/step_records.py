"""What a logged step says: loss, throughput and MFU over the window since the last log line,
memory; and the one-line summary at the end of a run."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kiln.config import JobConfig
from kiln.metrics.logger import JSONL_NAME, MetricsLogger, read_metrics, truncate_after
from kiln.metrics.mfu import mfu, peak_flops
from kiln.metrics.plot import redraw_loss_curve
from kiln.model import flops_per_token

if TYPE_CHECKING:
    from kiln.metrics.backends import Backend


class StepWindow:
    """Loss and throughput accumulated between two log lines, kept on the device until logged,
    so logging syncs the host with the device once per line, not once per step."""

    def __init__(self):
        self.start, self.tokens, self.steps, self.loss_sum = time.perf_counter(), 0, 0, 0.0

    def add(self, loss: torch.Tensor, tokens: int) -> None:
        self.loss_sum = self.loss_sum + loss.detach()
        self.tokens += tokens
        self.steps += 1

    def exclude(self, seconds: float) -> None:
        """Time spent on something else (evaluation, a checkpoint) is not training time."""
        self.start += seconds

    def mean_loss(self) -> float:
        return float(self.loss_sum) / self.steps

    def tokens_per_sec(self) -> float:
        return self.tokens / (time.perf_counter() - self.start)


def log_due(cfg: JobConfig, step: int) -> bool:
    """Whether `step` is logged: every metrics.log_interval steps, the first, the last
    (train.max_steps) and the steps that evaluate."""
    interval, last = cfg.metrics.log_interval, cfg.train.max_steps
    return step % interval == 0 or step in (1, last) or eval_due(cfg, step)


def eval_due(cfg: JobConfig, step: int) -> bool:
    """Whether the held-out loss or the harness's tasks are evaluated at `step`."""
    intervals = (cfg.eval.interval, cfg.eval.effective_tasks_interval)
    return any(every and step % every == 0 for every in intervals)


class StepLog:
    """Which steps are logged (every `log_interval`, the first, the last, and eval steps), and
    their records: loss, throughput and MFU over the window since the previous log line."""

    @classmethod
    def opened(
        cls,
        cfg: JobConfig,
        *,
        start_step: int,
        is_main: bool,
        num_devices: int,
        device: torch.device,
    ) -> StepLog:
        """The training run's log: metrics.jsonl and metrics.backends on the main rank."""
        from kiln.metrics.backends import open_backends

        backends = open_backends(cfg, start_step=start_step) if is_main else ()
        common = {"start_step": start_step, "is_main": is_main, "num_devices": num_devices}
        return cls(cfg, **common, device=device, backends=backends)

    def __init__(
        self,
        cfg: JobConfig,
        *,
        start_step: int,
        is_main: bool,
        num_devices: int,
        device: torch.device,
        backends: Sequence[Backend] = (),
    ):
        """`backends` and metrics.jsonl are written by the main rank only."""
        train = cfg.train
        self.logger = MetricsLogger(
            Path(cfg.metrics.run_dir),
            max_steps=train.max_steps,
            start_step=start_step,
            jsonl=cfg.metrics.jsonl and is_main,
            backends=backends,
        )
        self.cfg = cfg
        self.flops_per_token = flops_per_token(cfg.model, train.seq_len)
        self.peak_flops = peak_flops(device)
        self.num_devices, self.device = num_devices, device
        self.window = StepWindow()

    def excluding(self, action: Callable[[], None]) -> None:
        """Run `action` (an evaluation, a checkpoint) off the training clock."""
        started = time.perf_counter()
        action()
        self.exclude(time.perf_counter() - started)

    def close(self) -> None:
        self.logger.close()

    def rolled_back_to(self, step: int) -> None:
        """The run continues after `step` again: the records past it are dropped."""
        if self.logger.path is not None:
            truncate_after(self.logger.path, step)

    def add(self, loss: torch.Tensor, tokens: int) -> None:
        self.window.add(loss, tokens)

    def due(self, step: int) -> bool:
        return log_due(self.cfg, step)

    def eval_due(self, step: int) -> bool:
        """The held-out loss or the harness's tasks are evaluated at `step`."""
        return eval_due(self.cfg, step)

    def record(
        self, *, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, tokens_seen: int
    ) -> dict[str, Any]:
        """The record of `step`, starting a new window. The window's mean syncs with the device
        before the clock is read, so the elapsed time is honest."""
        window, self.window = self.window, StepWindow()
        loss_avg = window.mean_loss()
        tokens_per_sec = window.tokens_per_sec()
        on_gpu = self.device.type == "cuda"
        return {
            "step": step,
            "loss": loss.item(),
            "loss_avg": loss_avg,
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "tokens_seen": tokens_seen,
            "tokens_per_sec": tokens_per_sec,
            "mfu": mfu(
                flops_per_token=self.flops_per_token,
                tokens_per_sec=tokens_per_sec,
                peak=self.peak_flops,
                num_devices=self.num_devices,
            ),
            "peak_mem_gb": torch.cuda.max_memory_allocated(self.device) / 1e9 if on_gpu else None,
            "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        }

    def exclude(self, seconds: float) -> None:
        """Time spent on something else (evaluation, a checkpoint) is not training time."""
        self.window.exclude(seconds)


def run_summary(cfg: JobConfig, *, step: int, checkpoint: Path | None) -> str:
    """One line: the last step, how far the mean loss fell, the newest checkpoint, the plot."""
    history = read_metrics(Path(cfg.metrics.run_dir) / JSONL_NAME)
    lines = [f"kiln: finished step {step}"]
    if history:
        first, last = history[0]["loss_avg"], history[-1]["loss_avg"]
        lines.append(
            f"mean loss {first:.4f} (step {history[0]['step']}) -> {last:.4f} "
            f"({100 * last / first:.0f}% of first)"
        )
    if checkpoint is not None:
        lines.append(f"checkpoint {checkpoint}")
    curve = redraw_loss_curve(cfg) if history else None
    if curve is not None:
        lines.append(f"loss curve {curve}")
    return " | ".join(lines)
