"""Checks of `checkpoint.export_hf` that need only the config. Whether the model's family can
export it is asked of the family (kiln/checkpoint/hf_export.py, before anything is built)."""

from __future__ import annotations

from kiln.config.sections import JobConfig
from kiln.remote import is_url


def export_hf_problems(cfg: JobConfig) -> list[str]:
    """What makes `checkpoint.export_hf` impossible or meaningless in this run."""
    c = cfg.checkpoint
    if c.export_hf == "never":
        return []
    key = f'checkpoint.export_hf = "{c.export_hf}"'
    p = []
    if is_url(c.dir):
        p.append(
            f"{key} writes a local folder beside the checkpoints, but checkpoint.dir = "
            f"{c.dir!r} is in an object store; leave export_hf out and run `kiln convert "
            "kiln-to-hf CKPT OUT` on the checkpoint after the run"
        )
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
