"""Per-step metrics: a readable stdout line with a progress bar and ETA, metrics.jsonl, and the
logging backends (kiln/metrics/backends.py) under the same names."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import KilnError
from kiln.log import info

if TYPE_CHECKING:
    from kiln.metrics.backends import Backend

JSONL_NAME = "metrics.jsonl"
# Under fault tolerance each replica group logs to <run_dir>/replica_group_<g>/.
GROUP_DIR_PREFIX = "replica_group_"


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        *,
        max_steps: int,
        start_step: int,
        jsonl: bool = True,
        backends: Sequence[Backend] = (),
    ):
        self.path = Path(run_dir) / JSONL_NAME if jsonl else None
        self.backends = list(backends)
        self.max_steps = max_steps
        self.start_step = start_step
        self.start_time = time.perf_counter()
        if self.path is not None:
            truncate_after(self.path, start_step)

    def log(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.backends:
            values = scalars(record)
            for backend in self.backends:
                backend.log(record["step"], values)
        print(self.format_line(record), flush=True)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.backends = []

    def format_line(self, r: dict[str, Any]) -> str:
        step = r["step"]
        done = (step - self.start_step) / max(1, self.max_steps - self.start_step)
        elapsed = time.perf_counter() - self.start_time
        eta = elapsed / done * (1 - done) if done > 0 else math.nan
        filled = int(20 * step / self.max_steps)
        parts = [
            f"step {step:>{len(str(self.max_steps))}}/{self.max_steps} [{'#' * filled}{'.' * (20 - filled)}] eta {_duration(eta)}",
            f"loss {r['loss']:.4f} (mean {r['loss_avg']:.4f})",
            f"grad_norm {r['grad_norm']:.3f}",
            f"lr {r['lr']:.2e}",
            f"tok/s {r['tokens_per_sec']:,.0f}",
        ]
        # A model's own losses (multi-token prediction's per depth) beside the loss, which
        # leaves them out.
        parts[2:2] = [f"{k} {v:.4f}" for k, v in r.items() if k.startswith("mtp_loss_")]
        if r.get("eval/loss") is not None:
            parts.append(f"eval {r['eval/loss']:.4f} (ppl {r['eval/perplexity']:.1f})")
        # Harness tasks' scores: eval/<task>/<metric>.
        scores = [
            f"{k[5:]} {v:.4g}" for k, v in r.items() if k.startswith("eval/") and k.count("/") > 1
        ]
        if scores:
            parts.append("tasks: " + ", ".join(scores))
        per_dataset = [f"{k[5:]} {v:.3f}" for k, v in r.items() if k.startswith("loss/")]
        if per_dataset:
            parts.append("loss by dataset: " + ", ".join(per_dataset))
        if r.get("mfu") is not None:
            parts.append(f"mfu {100 * r['mfu']:.1f}%")
        if r.get("peak_mem_gb") is not None:
            parts.append(f"mem {r['peak_mem_gb']:.1f}GB")
        if r.get("ep/all_to_all_share") is not None:
            # The most any rank of the ep group spent in the exchanges (waits for the others
            # included), and the most it sent.
            share, sent = max(r["ep/all_to_all_share"]), max(r["ep/sent_tokens"])
            parts.append(f"all-to-all {100 * share:.0f}% of step, {sent:,} tokens out")
        return " | ".join(parts)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """Every number of a metrics.jsonl record by its flattened name (`step` is the x-axis)."""
    found: dict[str, float] = {}
    for name, value in record.items():
        if name != "step":
            _flatten(name, value, found)
    return found


def _flatten(name: str, value: Any, found: dict[str, float]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{name}/{key}", item, found)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _flatten(f"{name}/{index}", item, found)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        found[name] = float(value)


def metrics_dir(run_dir: Path, replica_group: int | None = None) -> Path:
    """The folder of a run's metrics.jsonl: `run_dir`, or for a fault-tolerance run, whose
    groups log on their own, its `replica_group`'s (group 0's by default, said on stderr)."""
    run_dir = Path(run_dir)
    groups = sorted(
        int(path.name.removeprefix(GROUP_DIR_PREFIX))
        for path in run_dir.glob(f"{GROUP_DIR_PREFIX}*")
        if path.name.removeprefix(GROUP_DIR_PREFIX).isdigit() and (path / JSONL_NAME).is_file()
    )
    if replica_group is None:
        if (run_dir / JSONL_NAME).is_file() or not groups:
            return run_dir
        replica_group = groups[0]
        others = ", ".join(map(str, groups))
        info(
            f"{run_dir} is a fault-tolerance run: reading replica group {replica_group}'s "
            f"metrics (groups {others}; --replica-group G for another)"
        )
    elif replica_group not in groups:
        found = f"it has groups {', '.join(map(str, groups))}" if groups else "it has none"
        raise KilnError(
            f"{run_dir} has no {GROUP_DIR_PREFIX}{replica_group}/{JSONL_NAME} ({found}); "
            "--replica-group picks a group of a fault-tolerance run"
        )
    return run_dir / f"{GROUP_DIR_PREFIX}{replica_group}"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_after(path: Path, step: int) -> None:
    """Drop records past `step`: a run resumed from a checkpoint at `step` logs those steps again."""
    records = read_metrics(path)
    kept = [r for r in records if r["step"] <= step]
    if len(kept) != len(records):
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "--:--"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"
