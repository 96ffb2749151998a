"""The model and optimizer state one replica group sends a rejoining one (fault tolerance):
each rank's own shards as plain tensors, loaded by the rank of the same place in the other
group. The groups' layouts are the same, so a shard lands where it was read from, bitwise."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from kiln.checkpoint.fingerprint import fingerprint_changes
from kiln.checkpoint.state import FLAT, Modules, Optimizers, pairs, state_dicts
from kiln.errors import KilnError


def local_state(model: Modules, optimizer: Optimizers) -> list[dict[str, dict]]:
    """Per model part this rank's model and optimizer shards, without a copy (the sender's
    transport holds the step's optimizer update back until a peer has read them)."""
    return [
        {
            kind: {key: _local(value) for key, value in values.items()}
            for kind, values in part.items()
        }
        for part in state_dicts(model, optimizer)
    ]


@torch.no_grad()
def load_local_state(model: Modules, optimizer: Optimizers, parts: list[dict[str, dict]]) -> None:
    """Copy a peer's `local_state` into this rank's shards (its optimizer state initialized first
    by torch if this rank has not stepped yet)."""
    own_parts = state_dicts(model, optimizer)
    assert len(own_parts) == len(parts), "the groups run the same model parts"
    for (module, optim), own, peer in zip(pairs(model, optimizer), own_parts, parts, strict=True):
        for kind, values in own.items():
            _copy_into(values, peer[kind], what=kind)
        set_model_state_dict(module, own["model"])
        if optim is not None:
            set_optimizer_state_dict(module, optim, own["optim"], options=FLAT)


def peer_state(
    train: dict[str, Any], layout: dict[str, int], model: Modules, optimizer: Optimizers
) -> dict[str, Any]:
    """What a live group's rank sends the rank of the same place in a rejoining group: the
    train state (data position, step, settings), the group's layout and its shards."""
    return {"train": train, "layout": layout, "parts": local_state(model, optimizer)}


def check_same_run(group: int, *, peer: dict[str, Any], own: dict[str, Any]) -> None:
    """A group rejoins only a run of its own settings and layout (`peer_state`s): another
    one's state would mix two runs, or not fit its shards."""
    changes = fingerprint_changes(
        peer["train"]["fingerprint"] | {"layout": peer["layout"]},
        own["train"]["fingerprint"] | {"layout": own["layout"]},
    )
    if changes:
        raise KilnError(
            f"replica group {group} cannot rejoin: the live groups train with other settings "
            f"({'; '.join(changes)}). Start it with the same recipe and overrides as the others"
        )


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _copy_into(own: dict[str, Any], peer: dict[str, Any], *, what: str) -> None:
    missing = sorted(set(own) ^ set(peer))
    assert not missing, f"the peer's {what} state has other keys: {missing[:5]}"
    for key, value in peer.items():
        target = own[key]
        if isinstance(target, torch.Tensor):
            _local(target).copy_(value)
        else:
            own[key] = value
