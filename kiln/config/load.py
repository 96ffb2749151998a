"""TOML file + model preset + CLI overrides -> a typed JobConfig, collecting every problem at once."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from kiln.config.sections import JobConfig, MoEConfig
from kiln.errors import ConfigError
from kiln.log import info, warn

# Presets and recipes ship inside the package (`kiln/configs`); in a source checkout that folder
# is a link to `configs/` at the repository root, so both read the same files.
SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MODEL_PRESET_DIR = SHIPPED_CONFIGS / "model"
RECIPE_DIR = SHIPPED_CONFIGS / "train"


def load_config(
    path: str | Path | None,
    overrides: list[str] = (),
    *,
    world_size: int | None = None,
    launched: int | None = None,
) -> JobConfig:
    """Read a TOML recipe, apply `--section.key=value` overrides and build the typed config.

    With `world_size` (the job's processes) or `launched` (torchrun's, one replica group's
    under fault tolerance), also validate against it. Raises ConfigError naming every problem
    (unknown keys, wrong types, invalid values, layout) at once.
    """
    raw = read_toml(find_recipe(path)) if path is not None else {}
    return config_from_dict(raw, overrides, source=path, world_size=world_size, launched=launched)


def config_from_dict(
    raw: dict[str, Any],
    overrides: list[str] = (),
    *,
    source: str | Path | None = None,
    world_size: int | None = None,
    launched: int | None = None,
) -> JobConfig:
    """`world_size`: validate for a job of that many processes; `launched`: for the job of
    which torchrun launched that many (one replica group under fault tolerance)."""
    from kiln.config.validate import collect_problems
    from kiln.config.validate_fault_tolerance import job_world_size

    problems: list[str] = []
    move_moe_keys(raw.get("model"), "", problems)
    for item in overrides:
        apply_override(raw, item, problems)
    resolve_model_preset(raw, problems)
    cfg = build_dataclass(JobConfig, raw, "", problems)
    if launched is not None:
        world_size = job_world_size(cfg, launched)
    if world_size is not None:
        problems += collect_problems(cfg, world_size)
    if problems:
        raise ConfigError.listing(problems, source)
    return cfg


def find_recipe(path: str | Path) -> Path:
    """The recipe `path` names: that file if it exists, else the copy shipped with kiln of
    `configs/...` or of a bare recipe name (`7b`, `7b.toml`), so an installed kiln runs the
    documented commands from any directory. Says so on rank 0 when it uses the copy."""
    given = Path(path)
    if given.is_file():
        return given
    shipped = _shipped_copy(given)
    if shipped is None or not shipped.is_file():
        known = ", ".join(sorted(p.stem for p in RECIPE_DIR.glob("*.toml")))
        raise ConfigError(
            f"config file not found: {given} (pass the path to a TOML recipe, or the name of one "
            f"shipped with kiln: {known})"
        )
    if os.environ.get("RANK", "0") == "0":
        info(f"{given} is not here; using the one shipped with kiln: {shipped}")
    return shipped


def _shipped_copy(given: Path) -> Path | None:
    if given.is_absolute():
        return None
    if len(given.parts) == 1:
        name = given.name
        return RECIPE_DIR / (name if name.endswith(".toml") else f"{name}.toml")
    if given.parts[0] == "configs":
        return SHIPPED_CONFIGS.joinpath(*given.parts[1:])
    return None


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config file not found: {path} (pass the path to a TOML recipe, e.g. configs/train/debug.toml)"
        )
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: TOML syntax error: {e}. Fix the line it names.") from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """`--train.max_steps=200` -> (["train", "max_steps"], 200); values are TOML literals, else strings."""
    body = item[2:] if item.startswith("--") else item
    if "=" not in body:
        raise ConfigError(f"override {item!r} needs a value: write --section.key=value")
    key, text = body.split("=", 1)
    parts = key.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ConfigError(
            f"override {item!r}: the key must be section.key (or section.table.key), "
            "e.g. --train.max_steps=200 or --optimizer.adamw.lr=3e-4"
        )
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return parts, value


def apply_override(raw: dict[str, Any], item: str, problems: list[str]) -> None:
    parts, value = parse_override(item)
    if len(parts) == 2 and parts[0] == "model" and parts[1] in MOVED_MOE_KEYS:
        # An old spelling (--model.moe_top_k=4): it sets [model.moe] top_k.
        parts = ["model", "moe", _moved(f"model.{parts[1]}")]
    if _is_text(_field_type(parts)) and not isinstance(value, str):
        value = item.split("=", 1)[1]  # `--metrics.run_dir=2024-01-01` is a name, not a date
    table = raw
    for depth, name in enumerate(parts[:-1]):
        table = table.setdefault(name, {})
        if not isinstance(table, dict):
            where = ".".join(parts[: depth + 1])
            problems.append(f"[{where}] is not a table, cannot override {'.'.join(parts)}")
            return
    table[parts[-1]] = value


def _field_type(parts: list[str]) -> Any:
    hint: Any = JobConfig
    for name in parts:
        if not dataclasses.is_dataclass(hint):
            return None
        hint = field_types(hint).get(name)
    return hint


def _is_text(hint: Any) -> bool:
    """A string field: `str`, a Literal of strings (one of a few words), or either | None."""
    hint = _without_none(hint)
    if typing.get_origin(hint) is typing.Literal:
        return all(isinstance(option, str) for option in typing.get_args(hint))
    return hint is str


def resolve_model_preset(raw: dict[str, Any], problems: list[str]) -> None:
    """Merge `[model] preset = NAME` under the explicit [model] keys (explicit keys win), and the
    preset's tables (`[moe]`, `[mla]`, `[mtp]`, `[linear_attention]`) under the explicit
    `[model.<table>]` keys, key by key."""
    model = raw.get("model")
    if not isinstance(model, dict) or not model.get("preset"):
        return
    name = model["preset"]
    path = Path(name) if str(name).endswith(".toml") else MODEL_PRESET_DIR / f"{name}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in MODEL_PRESET_DIR.glob("*.toml"))
        problems.append(
            f"model.preset: unknown preset {name!r}{did_you_mean(str(name), known)}; known presets: {', '.join(known)}"
        )
        return
    try:
        preset = read_toml(path)
    except ConfigError as e:
        problems.append(str(e))
        return
    move_moe_keys(preset, f"model.preset {name!r}: ", problems)
    merged = {**preset, **model}
    for table in ("moe", "mla", "mtp", "linear_attention"):
        if isinstance(preset.get(table), dict) and isinstance(model.get(table), dict):
            merged[table] = {**preset[table], **model[table]}
    raw["model"] = merged


def did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# Keys a release removed, with why: still accepted (the resolved config.toml of every older run
# and checkpoint holds them), ignored, with a note. docs/configuration.md lists them.
REMOVED_KEYS = {
    "distributed.shared_memory_collectives": (
        "CPU runs use gloo's collectives (the shared-memory ones are a test-suite accelerator now)"
    ),
}
_noted: set[str] = set()


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved type hints of a config dataclass, once per class: resolving them costs
    milliseconds, and `kiln plan` checks thousands of candidate layouts."""
    return typing.get_type_hints(cls)


def build_dataclass(cls: type, data: dict[str, Any], where: str, problems: list[str]) -> Any:
    hints = field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    data = {key: value for key, value in data.items() if not _removed(f"{where}{key}")}
    for key in data:
        if key not in names:
            what = "section" if not where else "key"
            full = f"{where}{key}"
            problems.append(f"unknown {what} {full!r}{did_you_mean(key, names)}")
    kwargs = {}
    for name in names:
        if name in data:
            kwargs[name] = convert(data[name], hints[name], f"{where}{name}", problems)
    kwargs = {k: v for k, v in kwargs.items() if v is not _INVALID}
    return cls(**kwargs)


def _removed(key: str) -> bool:
    """Whether `key` is one of REMOVED_KEYS; says so on stderr once per process."""
    if key not in REMOVED_KEYS:
        return False
    if key not in _noted:
        _noted.add(key)
        warn(
            f"note: {key} was removed and is ignored: {REMOVED_KEYS[key]}. "
            "Delete it from the recipe (an older checkpoint's config.toml may keep it)."
        )
    return True


# Keys a release moved into a table of their own, by their old name: the Mixture-of-Experts keys
# of [model] went into [model.moe], `num_experts` under its own name and `moe_<key>` as `<key>`
# (`moe_top_k` -> [model.moe] top_k). Still read wherever [model] is (a recipe, a preset, an
# override --model.moe_top_k=4, the config.toml of every older run and checkpoint): moved before
# the dataclasses are built, with a note once per process per key; a key given in both spellings
# is an error. docs/configuration.md states the rule.
MOVED_MOE_KEYS = {
    (name if name == "num_experts" else f"moe_{name}"): name
    for name in (f.name for f in dataclasses.fields(MoEConfig))
}


def move_moe_keys(model: Any, where: str, problems: list[str]) -> None:
    """Move the old flat MoE keys of the [model] table `model` into its `moe` table, in place.
    `where` starts a problem's message: "" for the recipe, which preset for a preset."""
    if not isinstance(model, dict) or not any(key in MOVED_MOE_KEYS for key in model):
        return
    moe = model.setdefault("moe", {})
    if not isinstance(moe, dict):
        return  # reported by build_dataclass: [model.moe] must be a table
    for old, new in MOVED_MOE_KEYS.items():
        if old not in model:
            continue
        if new in moe:
            problems.append(
                f"{where}model.{old} and model.moe.{new} are one key in two spellings (the old flat "
                f"[model] {old} and [model.moe] {new}): keep [model.moe] {new} and delete {old}"
            )
            del model[old]
            continue
        moe[new] = model.pop(old)
        _moved(f"model.{old}")


def moved_key(key: str) -> str:
    """The current name of the flat config key `key` ("model.moe_top_k" -> "model.moe.top_k");
    any other key unchanged. For what older runs recorded under the old names (fingerprints)."""
    section, _, name = key.partition(".")
    if section == "model" and name in MOVED_MOE_KEYS:
        return f"model.moe.{MOVED_MOE_KEYS[name]}"
    return key


def _moved(key: str) -> str:
    """The [model.moe] name of the old flat key `key` ("model.moe_top_k" -> "top_k"); says so on
    stderr once per process."""
    new = MOVED_MOE_KEYS[key.removeprefix("model.")]
    if key not in _noted:
        _noted.add(key)
        warn(
            f"note: {key} was moved to [model.moe] and is read as model.moe.{new}. Rewrite it as "
            f"{new} under [model.moe] in the recipe (an older checkpoint's config.toml may keep it)."
        )
    return new


_INVALID = object()
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def convert(value: Any, hint: Any, where: str, problems: list[str]) -> Any:
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            problems.append(f"[{where}] must be a table, got {value!r}")
            return _INVALID
        return build_dataclass(hint, value, f"{where}.", problems)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [h for h in typing.get_args(hint) if h is not type(None)]
        return convert(value, options[0], where, problems)
    if origin is typing.Literal:
        problem = choice_problem(value, hint, where)
        if problem:
            problems.append(problem)
            return _INVALID
        return value
    if origin is list:
        (item_hint,) = typing.get_args(hint)
        if not isinstance(value, list):
            problems.append(f"{where}: expected a list, got {value!r}")
            return _INVALID
        items = [convert(v, item_hint, f"{where}[{i}]", problems) for i, v in enumerate(value)]
        return _INVALID if any(i is _INVALID for i in items) else items
    if origin is dict:
        _, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            problems.append(f"{where}: expected a table, got {value!r}")
            return _INVALID
        items = {k: convert(v, value_hint, f"{where}.{k}", problems) for k, v in value.items()}
        return _INVALID if any(v is _INVALID for v in items.values()) else items
    ok = (
        (hint is bool and isinstance(value, bool))
        or (hint is int and isinstance(value, int) and not isinstance(value, bool))
        or (hint is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (hint is str and isinstance(value, str))
    )
    if not ok:
        problems.append(
            f"{where}: expected {_TYPE_WORDS.get(hint, hint)}, got {value!r} ({type(value).__name__})"
        )
        return _INVALID
    return float(value) if hint is float else value


def choice_problem(value: Any, hint: Any, where: str) -> str | None:
    """The problem with `value` for a key typed `Literal[...]` of words, or None when it is one."""
    options = typing.get_args(hint)
    if isinstance(value, str) and value in options:
        return None
    close = did_you_mean(value, list(options)) if isinstance(value, str) else ""
    return f"{where} = {value!r} is not one of {', '.join(map(repr, options))}{close}"


def choice_problems(obj: Any, where: str = "") -> list[str]:
    """Every Literal-typed key of the dataclass `obj` (and of the dataclasses inside it) whose
    value is not one of its words: a config built in Python rather than from TOML is not checked
    by `convert`, and a Literal is not enforced at run time."""
    problems = []
    for name, hint in field_types(type(obj)).items():
        value, key = getattr(obj, name), f"{where}{name}"
        if typing.get_origin(hint) in (typing.Union, types.UnionType) and value is None:
            continue
        hint = _without_none(hint)
        if typing.get_origin(hint) is typing.Literal:
            problem = choice_problem(value, hint, key)
            problems += [problem] if problem else []
        elif dataclasses.is_dataclass(value):
            problems += choice_problems(value, f"{key}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    problems += choice_problems(item, f"{key}[{i}].")
    return problems


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [h for h in typing.get_args(hint) if h is not type(None)]
        return options[0] if len(options) == 1 else hint
    return hint
