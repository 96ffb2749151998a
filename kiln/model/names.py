"""Parameter names as the model defines them, whatever wraps its modules."""

from __future__ import annotations

_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """Parameter name without the prefixes wrappers (activation checkpointing, compile) insert."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name
