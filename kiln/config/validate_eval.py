"""Problems with [eval]'s harness tasks (eval.tasks), found before anything is built; the task
names themselves are checked against the harness when the trainer starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kiln.config.sections import JobConfig


def eval_task_problems(cfg: JobConfig) -> list[str]:
    e, d, p = cfg.eval, cfg.distributed, []
    if e.tasks_interval < 0 or e.tasks_limit < 0 or e.tasks_num_fewshot < -1:
        p.append(
            "eval.tasks_interval and eval.tasks_limit must be >= 0 and eval.tasks_num_fewshot >= -1 "
            f"(-1: each task's own), got {e.tasks_interval}, {e.tasks_limit} and "
            f"{e.tasks_num_fewshot}"
        )
    if not e.tasks:
        if e.tasks_interval or e.tasks_path:
            p.append("eval.tasks_interval and eval.tasks_path are set but eval.tasks is empty")
        return p
    # Looked up, not imported: `kiln check` validates without paying for the import.
    if importlib.util.find_spec("lm_eval") is None:
        p.append(
            "eval.tasks needs lm-evaluation-harness, which is not installed: "
            "pip install 'kiln[eval]' (or leave eval.tasks empty)"
        )
    if not e.effective_tasks_interval:
        p.append("eval.tasks is set but neither eval.tasks_interval nor eval.interval: set one")
    split = [f"{dim} = {getattr(d, dim)}" for dim in ("pp", "cp") if getattr(d, dim) > 1]
    if split:
        p.append(
            f"eval.tasks scores the training model, which the harness cannot run split by "
            f"{' and '.join(split)}: leave eval.tasks empty and score the checkpoints with "
            "`kiln eval CKPT --tasks ...` in a layout without pipeline or context parallel"
        )
    if e.tasks_path and not Path(e.tasks_path).is_dir():
        p.append(f"eval.tasks_path = {e.tasks_path!r} is not a directory of task YAML files")
    return p
