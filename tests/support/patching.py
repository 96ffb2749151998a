"""Replace a function of kiln from the outside, wherever kiln's modules hold it.

A module that did `from kiln.parallel.fsdp import gradient_average_compensation` holds its own
reference, so patching only the defining module would miss it: every loaded `kiln` module bound
to the original is rebound, and undoing rebinds every module bound to the replacement (also those
that imported it while it was installed)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def patch(module_name: str, attr: str, make: Callable) -> Callable[[], None]:
    """Bind `make(original)` in place of `module_name.attr` across kiln; return the undo."""
    original = getattr(importlib.import_module(module_name), attr)
    replacement = make(original)
    _rebind(original, replacement, attr)
    return lambda: _rebind(replacement, original, attr)


def _rebind(old, new, attr: str) -> None:
    for name, module in list(sys.modules.items()):
        if (name == "kiln" or name.startswith("kiln.")) and getattr(module, attr, None) is old:
            setattr(module, attr, new)
