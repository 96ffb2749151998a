"""Checks of `checkpoint.export_hf` that need only the config. Whether the model's family can
export it, and whether checkpoint.dir is local, are checked by kiln/checkpoint/hf_export.py
before anything is built (config imports nothing above it)."""

from __future__ import annotations

from kiln.config.sections import JobConfig


def export_hf_problems(cfg: JobConfig) -> list[str]:
    """What makes `checkpoint.export_hf` impossible or meaningless in this run."""
    c = cfg.checkpoint
    if c.export_hf == "never":
        return []
    key = f'checkpoint.export_hf = "{c.export_hf}"'
    p = []
    if c.export_hf == "final" and not c.save_final:
        p.append(
            f"{key} exports the checkpoint the run's end commits, but checkpoint.save_final = "
            'false: set save_final = true, or export_hf = "every_save"'
        )
    if c.export_hf == "every_save" and not c.interval and not c.save_final:
        p.append(
            f"{key} but the run saves no checkpoint (checkpoint.interval = 0, save_final = "
            "false): set checkpoint.interval or save_final = true, or leave export_hf out"
        )
    return p
