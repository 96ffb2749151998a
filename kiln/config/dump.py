"""Write a resolved JobConfig as TOML (tomllib only reads), so a run directory records what ran."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from kiln.config.sections import JobConfig


def to_toml(cfg: JobConfig) -> str:
    lines: list[str] = []
    for section in dataclasses.fields(cfg):
        values = dataclasses.asdict(getattr(cfg, section.name))
        lines.append(f"[{section.name}]")
        # Lists of tables are written after the plain keys: TOML puts them in their own blocks.
        tables = {k: v for k, v in values.items() if _is_table_list(v)}
        # An unset optional key (None) is left out: reading the file back leaves it unset.
        lines += [
            f"{k} = {_literal(v)}" for k, v in values.items() if k not in tables and v is not None
        ]
        lines.append("")
        for key, entries in tables.items():
            for entry in entries:
                lines.append(f"[[{section.name}.{key}]]")
                lines += [f"{k} = {_literal(v)}" for k, v in entry.items()]
                lines.append("")
    return "\n".join(lines)


def write_config(cfg: JobConfig, path: Path) -> None:
    """Write `cfg` to `path` atomically: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(to_toml(cfg))
    os.replace(tmp, path)


def _is_table_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        items = [f"{json.dumps(k)} = {_literal(v)}" for k, v in value.items() if v is not None]
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")
