"""Save and load model, optimizer and trainer state with torch.distributed.checkpoint (DCP).

State dicts are keyed by parameter name (not by layout), so a checkpoint written by one
layout loads into another; DCP reads only the slices each rank owns.
"""

from __future__ import annotations

import io
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from kiln.checkpoint import layout
from kiln.checkpoint.saver import CheckpointSaver
from kiln.checkpoint.state import (
    FLAT,
    Modules,
    Optimizers,
    distributed,
    merged,
    pairs,
    rank,
    set_rng_state,
    single_process_quiet,
    state_dicts,
)
from kiln.checkpoint.store import Location, location, store_for
from kiln.config import JobConfig, ModelConfig, config_from_dict
from kiln.errors import KilnError, first_line
from kiln.parallel.agree import decide_on_main


def save_checkpoint(
    root: Location | str,
    step: int,
    *,
    model: Modules,
    optimizer: Optimizers,
    config: JobConfig,
    train_state: dict[str, Any],
    tokenizer_path: Path | None = None,
    keep_last_n: int = 0,
) -> Location:
    """Write and commit step `step` synchronously (see CheckpointSaver); its folder."""
    record = CheckpointSaver(root, keep_last_n=keep_last_n).save(
        step,
        model=model,
        optimizer=optimizer,
        config=config,
        train_state=train_state,
        tokenizer_path=tokenizer_path,
    )
    return record.path


@dataclass(frozen=True)
class Chosen:
    """A checkpoint to load as rank 0 judged it: its step folder, train state and the files its
    marker lists (None: a marker of an older kiln that lists none)."""

    path: Location
    train_state: dict[str, Any]
    files: frozenset[str] | None


def choose_checkpoint(path: Location | str) -> Chosen:
    """Resolve and judge `path` (see layout.resolve_checkpoint) and read what loading it needs."""
    try:
        path = layout.resolve_checkpoint(path)
        manifest = layout.read_manifest(path)
        state = read_train_state(path)
    except OSError as error:  # a KilnError like the others: every rank reports it the same way
        raise KilnError(f"cannot read the checkpoint {path}: {error}") from None
    return Chosen(path, state, None if manifest is None else frozenset(manifest))


def load_checkpoint(
    path: Location | str,
    *,
    model: Modules,
    optimizer: Optimizers = None,
    restore_rng: bool = False,
    extra: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Load weights (and optimizer state, RNG when asked) in place; return the saved train state.
    Collective: rank 0 resolves and judges the checkpoint and sends its choice; the other ranks
    read only the files it names, never a listing (a lagging or throttled view of the store on
    one rank would otherwise fail it while the others wait in DCP's collectives)."""
    chosen = decide_on_main(lambda: choose_checkpoint(path), what="choose the checkpoint to load")
    path = chosen.path
    store = store_for(path)
    parts = state_dicts(model, optimizer)
    state = merged(parts) | ({"extra": extra} if extra else {})  # `extra` is loaded in place
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=store.reader(path), no_dist=not distributed())
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        keys = _saved_keys(path)
        if optimizer is not None and not any(key.startswith("optim.") for key in keys):
            raise KilnError(
                f"{path} holds model weights only (a converted, exported or averaged model), no "
                "optimizer state: load it as a warm start with checkpoint.model_only = true"
            ) from None
        if optimizer is not None and _has_indexed_optimizer_state(keys):
            raise KilnError(
                f"{path} holds optimizer state in the indexed format of kiln before pipeline "
                "parallelism; this version keys it by parameter name. Start from its weights "
                f"with checkpoint.load_path = '{path}' in a fresh run directory"
            ) from None
        wanted = "model and optimizer" if optimizer is not None else "model"
        raise KilnError(
            f"cannot load the {wanted} state from {path}: {first_line(e)}. Does the checkpoint match this model config?"
        ) from None
    # The merged dicts hold the loaded tensors; each part takes back its own keys.
    for (module, optim), part in zip(pairs(model, optimizer), parts, strict=True):
        set_model_state_dict(module, {k: state["model"][k] for k in part["model"]})
        if optim is not None:
            loaded = {k: state["optim"][k] for k in part["optim"]}
            set_optimizer_state_dict(module, optim, loaded, options=FLAT)
    if restore_rng:
        rng_file = f"rng/rank_{rank():05d}.pt"
        # A layout with more ranks than the save has no RNG state for the new ones.
        saved = store.is_file(path / rng_file) if chosen.files is None else rng_file in chosen.files
        if saved:
            rng = torch.load(io.BytesIO(store.read_bytes(path / rng_file)), weights_only=False)
            set_rng_state(rng)
    return chosen.train_state


def _saved_keys(path: Location) -> set[str]:
    try:
        return set(store_for(path).reader(path).read_metadata().state_dict_metadata)
    except Exception:
        return set()


def _has_indexed_optimizer_state(keys: set[str]) -> bool:
    """Older saves listed each param group's parameters (`optim.param_groups.0.params`)."""
    return any(key.startswith("optim.param_groups.") and key.endswith(".params") for key in keys)


def read_train_state(path: Location | str) -> dict[str, Any]:
    path = location(path)
    file, store = path / "train_state.json", store_for(path)
    if not store.is_file(file):
        return {"step": 0}
    try:
        return json.loads(store.read_bytes(file).decode())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise KilnError(
            f"{file} is corrupt; resume from an earlier checkpoint or delete {path}"
        ) from None


def read_config(path: Location | str) -> dict[str, Any]:
    """The resolved config a checkpoint was written with, as its TOML tables."""
    path = location(path)
    config_file, store = path / "config.toml", store_for(path)
    if not store.is_file(config_file):
        raise KilnError(f"{path} has no config.toml: it was not written by kiln")
    try:
        return tomllib.loads(store.read_bytes(config_file).decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise KilnError(f"{config_file}: TOML syntax error: {e}") from None


def read_model_config(path: Location | str) -> ModelConfig:
    """The model section a checkpoint was written with."""
    raw = read_config(path)
    config_file = location(path) / "config.toml"
    raw.get("model", {}).pop("preset", None)  # the preset was resolved into explicit keys on save
    return config_from_dict(raw, source=str(config_file)).model
