"""What a checkpoint holds, independent of how it is written: model and optimizer state dicts
keyed by parameter name (not by layout, so any layout reads back the slices it owns) and the
per-rank RNG states."""

from __future__ import annotations

import contextlib
import random
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

# Optimizer state keyed by parameter name (`state.<fqn>.exp_avg`), so the states of several
# pipeline stages merge into one dict and any layout finds its parameters' entries.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

Modules = torch.nn.Module | list[torch.nn.Module]
Optimizers = torch.optim.Optimizer | list[torch.optim.Optimizer] | None


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def pairs(model: Modules, optimizer: Optimizers) -> list[tuple[torch.nn.Module, Any]]:
    """(module, its optimizer or None) per model part: a pipeline stage, or the whole model."""
    modules = model if isinstance(model, list) else [model]
    if optimizer is None:
        return [(module, None) for module in modules]
    return list(
        zip(modules, optimizer if isinstance(optimizer, list) else [optimizer], strict=True)
    )


def state_dicts(model: Modules, optimizer: Optimizers) -> list[dict[str, dict]]:
    """Per model part its model and optimizer state."""
    parts = []
    for module, optim in pairs(model, optimizer):
        part = {"model": get_model_state_dict(module)}
        if optim is not None:
            part["optim"] = get_optimizer_state_dict(module, optim, options=FLAT)
        parts.append(part)
    return parts


def merged(parts: list[dict[str, dict]]) -> dict[str, dict]:
    """One dict per kind over all parts. A name held by two parts (the tied embedding of the
    first and last stage) has equal values in both, so either copy serves."""
    out: dict[str, dict] = {}
    for part in parts:
        for kind, values in part.items():
            out.setdefault(kind, {}).update(values)
    return out


def merged_state(model: Modules, optimizer: Optimizers) -> dict[str, dict]:
    return merged(state_dicts(model, optimizer))


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns that it assumes one process when no process group exists; here that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
