"""Save and load model, optimizer and trainer state with torch.distributed.checkpoint (DCP).

State dicts are keyed by parameter name (not by layout), so a checkpoint written by one
layout loads into another; DCP reads only the slices each rank owns.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from kiln.checkpoint import layout
from kiln.config import JobConfig, ModelConfig, config_from_dict, read_toml, to_toml
from kiln.errors import KilnError

# Optimizer state keyed by parameter name (`state.<fqn>.exp_avg`), so the states of several
# pipeline stages merge into one dict and any layout finds its parameters' entries.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

Modules = torch.nn.Module | list[torch.nn.Module]
Optimizers = torch.optim.Optimizer | list[torch.optim.Optimizer] | None


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: Modules,
    optimizer: Optimizers,
    config: JobConfig,
    train_state: dict[str, Any],
    tokenizer_path: Path | None = None,
    keep_last_n: int = 0,
) -> Path:
    """Write step `step` into a hidden partial folder, then commit it (marker, rename, `latest`)."""
    root = Path(root)
    partial = layout.partial_dir(root, step)
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        layout.remove_partials(root)
        partial.mkdir()
    _barrier()
    state = _merged(_state_dicts(model, optimizer))
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=partial, no_dist=not _distributed())
    rng_dir = partial / "rng"
    rng_dir.mkdir(exist_ok=True)
    torch.save(_rng_state(), rng_dir / f"rank_{_rank():05d}.pt")
    _barrier()
    final = layout.step_dir(root, step)
    if _rank() == 0:
        (partial / "config.toml").write_text(to_toml(config))
        (partial / "train_state.json").write_text(
            json.dumps({"step": step, **train_state}, indent=2) + "\n"
        )
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, partial / "tokenizer.json")
        final = layout.commit(root, step)
        layout.prune(root, keep_last_n, keep=final)
    _barrier()
    return final


def load_checkpoint(
    path: Path,
    *,
    model: Modules,
    optimizer: Optimizers = None,
    restore_rng: bool = False,
) -> dict[str, Any]:
    """Load weights (and optimizer state, RNG when asked) in place; return the saved train state."""
    path = layout.resolve_checkpoint(path)
    parts = _state_dicts(model, optimizer)
    state = _merged(parts)
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path, no_dist=not _distributed())
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        if optimizer is not None and _has_indexed_optimizer_state(path):
            raise KilnError(
                f"{path} holds optimizer state in the indexed format of kiln before pipeline "
                "parallelism; this version keys it by parameter name. Start from its weights "
                f"with checkpoint.load_path = '{path}' in a fresh run directory"
            ) from None
        wanted = "model and optimizer" if optimizer is not None else "model"
        raise KilnError(
            f"cannot load the {wanted} state from {path}: {_first_line(e)}. Does the checkpoint match this model config?"
        ) from None
    # The merged dicts hold the loaded tensors; each part takes back its own keys.
    for (module, optim), part in zip(_pairs(model, optimizer), parts, strict=True):
        set_model_state_dict(module, {k: state["model"][k] for k in part["model"]})
        if optim is not None:
            loaded = {k: state["optim"][k] for k in part["optim"]}
            set_optimizer_state_dict(module, optim, loaded, options=_FLAT)
    if restore_rng:
        rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
        if rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=False))
    return read_train_state(path)


def _has_indexed_optimizer_state(path: Path) -> bool:
    """Older saves listed each param group's parameters (`optim.param_groups.0.params`)."""
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return any(key.startswith("optim.param_groups.") and key.endswith(".params") for key in keys)


def _pairs(model: Modules, optimizer: Optimizers) -> list[tuple[torch.nn.Module, Any]]:
    """(module, its optimizer or None) per model part: a pipeline stage, or the whole model."""
    modules = model if isinstance(model, list) else [model]
    if optimizer is None:
        return [(module, None) for module in modules]
    return list(
        zip(modules, optimizer if isinstance(optimizer, list) else [optimizer], strict=True)
    )


def _state_dicts(model: Modules, optimizer: Optimizers) -> list[dict[str, dict]]:
    """Per model part its model and optimizer state."""
    parts = []
    for module, optim in _pairs(model, optimizer):
        part = {"model": get_model_state_dict(module)}
        if optim is not None:
            part["optim"] = get_optimizer_state_dict(module, optim, options=_FLAT)
        parts.append(part)
    return parts


def _merged(parts: list[dict[str, dict]]) -> dict[str, dict]:
    """One dict per kind over all parts. A name held by two parts (the tied embedding of the
    first and last stage) has equal values in both, so either copy serves."""
    merged: dict[str, dict] = {}
    for part in parts:
        for kind, values in part.items():
            merged.setdefault(kind, {}).update(values)
    return merged


def read_train_state(path: Path) -> dict[str, Any]:
    file = Path(path) / "train_state.json"
    if not file.is_file():
        return {"step": 0}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError:
        raise KilnError(
            f"{file} is corrupt; resume from an earlier checkpoint or delete {path}"
        ) from None


def read_model_config(path: Path) -> ModelConfig:
    """The model section a checkpoint was written with."""
    config_file = Path(path) / "config.toml"
    if not config_file.is_file():
        raise KilnError(f"{path} has no config.toml: it was not written by kiln")
    raw = read_toml(config_file)
    raw.get("model", {}).pop("preset", None)  # the preset was resolved into explicit keys on save
    return config_from_dict(raw, source=config_file).model


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when no process group exists; here that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _first_line(error: BaseException) -> str:
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]  # the per-rank cause, not the wrapper
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
