"""The torch releases kiln supports, checked when kiln is imported.

Clusters install their own CUDA build of torch; kiln declares a range (pyproject.toml) rather than
one version so that installing it keeps that build, and works across the range through feature
checks where torch's APIs moved (kiln/parallel/context_parallel.py). The repository's lock
(requirements.txt) pins the release the test suite runs on.
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings

OLDEST = (2, 11)
NEWEST = (2, 13)
SUPPORTED = f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"


def torch_version_problem(version: str) -> str | None:
    """Why torch `version` cannot run kiln, or None; an unparseable version (a source build's
    label) is given the benefit of the doubt."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) >= OLDEST:
        return None
    return (
        f"kiln supports torch {SUPPORTED}; this environment has torch {version}. Install a "
        f"supported release (pip install 'torch>={OLDEST[0]}.{OLDEST[1]},<{NEWEST[0]}.{NEWEST[1] + 1}'), "
        "the build for your CUDA version from https://pytorch.org/get-started/locally/"
    )


def require_supported_torch() -> None:
    """Refuse a torch older than the range with one message; warn once about a newer, untested one.
    Reads the installed package's metadata, so importing kiln does not import torch."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return  # no torch at all: the first `import torch` says so
    problem = torch_version_problem(version)
    if problem is not None:
        raise ImportError(problem)
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is not None and (int(match[1]), int(match[2])) > NEWEST:
        warnings.warn(
            f"kiln is tested on torch {SUPPORTED}; torch {version} is newer and untested",
            stacklevel=2,
        )
