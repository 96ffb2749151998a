"""Write a resolved JobConfig as TOML (tomllib only reads), so a run directory records what ran."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kiln.config.sections import JobConfig


def to_toml(cfg: JobConfig) -> str:
    lines: list[str] = []
    for section in dataclasses.fields(cfg):
        lines.append(f"[{section.name}]")
        for key, value in dataclasses.asdict(getattr(cfg, section.name)).items():
            lines.append(f"{key} = {_literal(value)}")
        lines.append("")
    return "\n".join(lines)


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
