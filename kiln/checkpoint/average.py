"""`kiln average`: a checkpoint whose weights are the mean of several checkpoints of one model.

Each checkpoint is read into one process whatever layout wrote it (DCP keys tensors by parameter
name, as `kiln convert` relies on), summed in float64 and divided once, so the mean of two
fp32 checkpoints is the correctly rounded fp32 mean. The result is written by the ordinary
checkpoint writer without optimizer state: it warm-starts a run (`checkpoint.load_path`), loads
in `kiln generate`, `kiln eval` and `kiln convert`, and is never resumed from. Its default place
is `<checkpoints dir>/average_<first>-<last>/`, a folder resume never takes for a step of the run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.checkpoint.checkpointer import (
    load_checkpoint,
    read_config,
    read_model_config,
    read_train_state,
    save_checkpoint,
)
from kiln.checkpoint.layout import complete_steps, damage, find_tokenizer
from kiln.checkpoint.manager import model_differences
from kiln.checkpoint.store import Location, location, store_for
from kiln.config import config_from_dict
from kiln.errors import ConfigError
from kiln.model import build_model, materialize

# What the averaged checkpoint's train_state.json says about its optimizer state.
NO_OPTIMIZER = (
    "none: the weights are the mean of the checkpoints in 'averaged', whose optimizer states "
    "are not averaged; start a run from it with checkpoint.load_path (model_only = true), "
    "which builds a fresh optimizer"
)


@dataclass(frozen=True)
class Averaged:
    """What `average_checkpoints` read and wrote."""

    sources: list[Location]
    path: Location


def average_checkpoints(
    source: str | Location,
    *,
    last: int | None = None,
    steps: list[int] | None = None,
    output: str | Location | None = None,
) -> Averaged:
    """Write the mean of the weights of the newest `last` intact checkpoints under `source` (a
    run directory or its checkpoints folder), or of the checkpoints of `steps`, into `output`
    (default `<checkpoints dir>/average_<first>-<last>`); nothing is written on bad input."""
    root = _checkpoints_root(source)
    chosen = _choose(root, last=last, steps=steps)
    _check_same_model(chosen)
    first, newest = _step(chosen[0]), _step(chosen[-1])
    out = location(output) if output is not None else root / f"average_{first}-{newest}"
    store = store_for(out)
    if store.exists(out) and store.children(out):
        raise ConfigError(
            f"{out} already exists and is not empty: pass --output with a new folder, or delete it"
        )
    store.check_writable(out)  # before the checkpoints are read, which takes the time

    cfg = config_from_dict(_config_of(chosen[-1]), source=str(chosen[-1] / "config.toml"))
    model = materialize(build_model(cfg.model), device="cpu", seed=None)
    means = _mean_weights(model, chosen)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(means[name])
    tokenizer = find_tokenizer(chosen[-1])
    seen = {k: v for k, v in read_train_state(chosen[-1]).items() if k == "tokens_seen"}
    train_state = seen | {
        "averaged": [{"step": _step(path), "path": str(path)} for path in chosen],
        "optimizer": NO_OPTIMIZER,
    }
    written = save_checkpoint(
        out,
        newest,
        model=model,
        optimizer=None,
        config=cfg,
        train_state=train_state,
        tokenizer_path=tokenizer,
    )
    return Averaged(chosen, written)


def _mean_weights(model: torch.nn.Module, chosen: list[Location]) -> dict[str, torch.Tensor]:
    """Each weight's mean over the checkpoints, in the model's dtype: summed in float64 in the
    order given, divided once, rounded once."""
    sums: dict[str, torch.Tensor] = {}
    for path in chosen:
        load_checkpoint(path, model=model)
        for name, tensor in model.state_dict().items():
            assert tensor.is_floating_point(), f"{name}: only floating-point state is averaged"
            if name in sums:
                sums[name] += tensor.double()
            else:
                sums[name] = tensor.double()
    dtypes = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    return {name: (total / len(chosen)).to(dtypes[name]) for name, total in sums.items()}


def _checkpoints_root(source: str | Location) -> Location:
    """The checkpoints folder a run directory or checkpoints folder names."""
    root = location(source)
    store = store_for(root)
    if not store.exists(root):
        raise ConfigError(
            f"{root} not found: pass a run directory or its checkpoints folder (for a URL, "
            "check the bucket, prefix and spelling)"
        )
    if root.name.startswith("step_"):
        raise ConfigError(
            f"{root} is one checkpoint: pass the folder holding it ({root.parent}) with "
            f"--steps or --last to choose the checkpoints to average"
        )
    if not complete_steps(root) and store.exists(root / "checkpoints"):
        root = root / "checkpoints"
    if not complete_steps(root):
        raise ConfigError(
            f"{root} holds no committed checkpoint (step_XXXXXXXX folders with a COMPLETE "
            "marker): pass a run directory or its checkpoints folder"
        )
    return root


def _choose(root: Location, *, last: int | None, steps: list[int] | None) -> list[Location]:
    """The checkpoints to average, oldest first, each intact as resume judges it."""
    if (last is None) == (steps is None):
        raise ConfigError(
            "choose the checkpoints with --last K or with --steps a,b,c (one of them)"
        )
    count = last if last is not None else len(steps)
    if count < 2:
        raise ConfigError(
            f"averaging needs at least two checkpoints ({count} chosen): pass --last 2 or more, "
            "or two or more --steps"
        )
    committed = dict(complete_steps(root))
    if steps is not None:
        repeated = sorted({s for s in steps if steps.count(s) > 1})
        if repeated:
            raise ConfigError(f"--steps names step {repeated[0]} twice: list each step once")
        missing = [s for s in steps if s not in committed]
        if missing:
            raise ConfigError(
                f"{root} has no committed checkpoint of step {missing[0]}; it has steps "
                f"{_listing(committed)}: pass --steps from those"
            )
        for s in steps:
            problem = damage(committed[s])
            if problem is not None:
                raise ConfigError(
                    f"{committed[s]} is damaged ({problem}): choose --steps without it"
                )
        return [committed[s] for s in sorted(steps)]
    intact = []
    for s in sorted(committed, reverse=True):
        problem = damage(committed[s])
        if problem is None:
            intact.append(committed[s])
        else:  # passed over as resume passes over it
            print(f"kiln average: skipping {committed[s]}: {problem}", file=sys.stderr)
        if len(intact) == last:
            return intact[::-1]
    raise ConfigError(
        f"--last {last} asks for more checkpoints than {root} holds intact "
        f"({len(intact)}: steps {_listing({_step(p): p for p in intact})}): pass --last "
        f"{len(intact)} or fewer"
    )


def _check_same_model(chosen: list[Location]) -> None:
    """One model: every [model] setting that shapes or gives meaning to the weights equal (the
    rule a warm start applies), and the same tokenizer, whose ids the embedding rows stand for."""
    reference = read_model_config(chosen[-1])
    tokenizer = _tokenizer_bytes(chosen[-1])
    for path in chosen[:-1]:
        changes = [
            f"model.{key}: {old!r} in {_step(path)}, {new!r} in {_step(chosen[-1])}"
            for key, old, new in model_differences(read_model_config(path), reference)
        ]
        theirs = _tokenizer_bytes(path)
        if tokenizer is not None and theirs is not None and theirs != tokenizer:
            changes.append(f"tokenizer.json differs between {_step(path)} and {_step(chosen[-1])}")
        if changes:
            raise ConfigError(
                f"cannot average {path} with {chosen[-1]}: they hold different models "
                f"({'; '.join(changes)}). Average checkpoints of one model (its [model] settings "
                "and tokenizer alike), e.g. the last ones of one run with --last K"
            )


def _tokenizer_bytes(path: Location) -> bytes | None:
    found = find_tokenizer(path)
    return None if found is None else Path(found).read_bytes()


def _config_of(path: Location) -> dict:
    """The checkpoint's resolved config, its preset already written out as explicit keys."""
    raw = read_config(path)
    raw.get("model", {}).pop("preset", None)
    return raw


def _step(path: Location) -> int:
    return int(path.name.removeprefix("step_"))


def _listing(by_step: dict[int, Location]) -> str:
    return ", ".join(str(s) for s in sorted(by_step)) or "none"
