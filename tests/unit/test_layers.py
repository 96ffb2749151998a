"""Imports point one way (config ← model/data ← parallel/checkpoint ← train ← cli): each
subsystem's forbidden imports, read from the source, lazy imports inside functions included."""

import ast
from pathlib import Path

import pytest

import kiln

PACKAGE = Path(kiln.__file__).parent
FORBIDDEN = {
    "config": ("kiln.model", "kiln.data", "kiln.parallel", "kiln.checkpoint", "kiln.train"),
    "model": ("kiln.data", "kiln.parallel", "kiln.checkpoint", "kiln.train", "kiln.resilience"),
    "data": ("kiln.model", "kiln.parallel", "kiln.checkpoint", "kiln.train", "kiln.resilience"),
    "checkpoint": ("kiln.data", "kiln.train", "kiln.resilience", "kiln.metrics"),
    "parallel": ("kiln.data", "kiln.train", "kiln.checkpoint", "kiln.resilience"),
    "resilience": ("kiln.data", "kiln.parallel", "kiln.checkpoint", "kiln.train"),
    # The harness adapter sits under train, whose trainer scores [eval] tasks with it.
    "eval": ("kiln.train", "kiln.metrics", "kiln.resilience"),
}


def _imports(folder: str) -> list[tuple[Path, str]]:
    found = []
    for path in (PACKAGE / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.append((path, node.module))
            elif isinstance(node, ast.Import):
                found += [(path, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("folder", FORBIDDEN)
def test_a_subsystem_does_not_import_the_layers_above_it(folder):
    wrong = [
        f"{path.relative_to(PACKAGE)} imports {module}"
        for path, module in _imports(folder)
        if module.startswith(FORBIDDEN[folder])
    ]
    assert not wrong, wrong
