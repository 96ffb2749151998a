"""Validation of FP8 training (train.mixed_precision = "fp8", the [fp8] section)."""

from __future__ import annotations

import importlib.util

from kiln.config.sections import JobConfig


def float8_problems(cfg: JobConfig) -> list[str]:
    # fp8.recipe and fp8.high_precision are Literals, checked with the other choices.
    f, p = cfg.fp8, []
    if cfg.train.mixed_precision != "fp8":
        return p
    # Looked up, not imported: torchao's import costs seconds and validation runs in `kiln check`.
    if importlib.util.find_spec("torchao") is None:
        p.append(
            "train.mixed_precision = 'fp8' needs torchao, which is not installed: "
            "pip install 'kiln[fp8]' (or use mixed_precision = 'bf16')"
        )
    if f.fsdp_float8_all_gather and f.recipe != "tensorwise":
        p.append(
            "fp8.fsdp_float8_all_gather = true needs fp8.recipe = 'tensorwise' (one scale per "
            "weight, known before the gather); set it false for 'rowwise'"
        )
    return p
