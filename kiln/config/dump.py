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
        lines += _table(section.name, getattr(cfg, section.name))
    return "\n".join(lines)


def _table(name: str, obj: Any) -> list[str]:
    """`[name]` with the plain keys of the dataclass `obj`, then its nested dataclasses as tables
    of their own (`[model.moe]`), then its lists of tables: TOML puts those in their own blocks."""
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    tables = {k: v for k, v in values.items() if dataclasses.is_dataclass(v)}
    table_lists = {k: v for k, v in values.items() if _is_table_list(v)}
    lines = [f"[{name}]"]
    # An unset optional key (None) is left out: reading the file back leaves it unset.
    lines += [
        f"{k} = {_literal(v)}"
        for k, v in values.items()
        if k not in tables and k not in table_lists and v is not None
    ]
    lines.append("")
    for key, table in tables.items():
        lines += _table(f"{name}.{key}", table)
    for key, entries in table_lists.items():
        for entry in entries:
            lines.append(f"[[{name}.{key}]]")
            lines += [f"{k} = {_literal(v)}" for k, v in dataclasses.asdict(entry).items()]
            lines.append("")
    return lines


def write_config(cfg: JobConfig, path: Path) -> None:
    """Write `cfg` to `path` atomically: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(to_toml(cfg))
    os.replace(tmp, path)


def _is_table_list(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(dataclasses.is_dataclass(v) for v in value)
    )


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
