"""Problems with the logging backends and the profiler, found before anything is built."""

from __future__ import annotations

import importlib.util

from kiln.config.sections import JobConfig


def observability_problems(cfg: JobConfig, world_size: int) -> list[str]:
    return _backend_problems(cfg) + _profiling_problems(cfg, world_size)


def _backend_problems(cfg: JobConfig) -> list[str]:
    m, p = cfg.metrics, []
    # Looked up, not imported: `kiln check` validates without paying for their imports.
    if m.tensorboard and importlib.util.find_spec("tensorboard") is None:
        p.append(
            "metrics.tensorboard = true needs the tensorboard package, which is not installed: "
            "pip install 'kiln[tb]' (or set metrics.tensorboard = false)"
        )
    if m.wandb and importlib.util.find_spec("wandb") is None:
        p.append(
            "metrics.wandb = true needs the wandb package, which is not installed: "
            "pip install 'kiln[wandb]' (or set metrics.wandb = false)"
        )
    if m.wandb and not m.wandb_project:
        p.append("metrics.wandb = true needs metrics.wandb_project (the W&B project to log to)")
    return p


def _profiling_problems(cfg: JobConfig, world_size: int) -> list[str]:
    prof, p = cfg.profiling, []
    if not prof.enabled:
        return p
    last = min(cfg.train.stop_at_step or cfg.train.max_steps, cfg.train.max_steps)
    if not 1 <= prof.start_step <= prof.end_step <= last:
        p.append(
            f"profiling steps {prof.start_step}..{prof.end_step} are not a range inside this run "
            f"(steps 1..{last}): set 1 <= profiling.start_step <= profiling.end_step <= {last}"
        )
    outside = [r for r in prof.ranks if not 0 <= r < world_size]
    if outside:
        p.append(
            f"profiling.ranks {outside} are not ranks of a {world_size}-process job "
            f"(0..{world_size - 1}; an empty list traces every rank)"
        )
    return p
