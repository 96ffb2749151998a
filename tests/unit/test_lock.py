"""The locked environment: requirements.txt pins what pyproject asks for, within its ranges.

`make install` installs the lock exactly and `make lock` rewrites it; these checks catch a
pyproject edited without `make lock`, and a repository venv that has not been reinstalled since.
"""

import importlib.metadata
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.txt"


def _locked() -> dict[str, str]:
    """The lock's pins, name (normalized) -> version; every entry must be an exact `==` pin."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if not text:
            continue  # comments and uv's "# via" annotations
        req = Requirement(text)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==" and not req.marker, (
            f"requirements.txt: {line!r} is not an exact pin; run `make lock`"
        )
        pins[canonicalize_name(req.name)] = specs[0].version
    return pins


def _wanted() -> list[Requirement]:
    """What `make lock` resolves: pyproject's dependencies and its [dev] extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + project["optional-dependencies"]["dev"]
    return [Requirement(line) for line in lines]


def test_lock_pins_every_dependency_within_pyproject_ranges():
    pins = _locked()
    problems = []
    for req in _wanted():
        name = canonicalize_name(req.name)
        if name not in pins:
            problems.append(f"{req.name} is not in the lock")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{req.name}=={pins[name]} is outside pyproject's {req}")
    assert not problems, "requirements.txt is stale, run `make lock`: " + "; ".join(problems)


def test_repository_venv_has_the_locked_versions():
    # The promise holds for the venv `make install` builds, not for an environment someone made
    # with `pip install .` (pyproject's ranges), so anywhere else this check does not apply.
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip("not the repository's .venv that `make install` builds")
    problems = []
    for name, version in sorted(_locked().items()):
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{name} is not installed")
            continue
        # `==` as the installer reads it: the lock's torch==2.13.0 matches the CPU build 2.13.0+cpu.
        if not SpecifierSet(f"=={version}").contains(installed, prereleases=True):
            problems.append(f"{name} {installed} installed, {version} locked")
    assert not problems, ".venv differs from requirements.txt, run `make install`: " + "; ".join(
        problems
    )
