"""kiln installed from a wheel (not editable) and run outside the checkout: the presets and
recipes ship with the package, so the documented commands work from any directory."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def run(*args, cwd, env=None):
    result = subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        f"{args} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    )
    return result


def copy_source(dest: Path) -> Path:
    """The files a build reads, copied so the build writes nothing into the checkout."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dest / name)
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "kiln", dest / "kiln", symlinks=True, ignore=skip)
    shutil.copytree(REPO / "configs", dest / "configs", ignore=skip)
    return dest


def test_installed_kiln_checks_a_shipped_recipe_from_another_directory(tmp_path):
    source = copy_source(tmp_path / "source")
    site = tmp_path / "site"
    # No index and no build isolation: nothing is downloaded, torch is not reinstalled.
    run(
        *("-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation"),
        *("--target", site, source),
        cwd=tmp_path,
    )
    assert (site / "kiln" / "configs" / "train" / "7b.toml").is_file()
    assert not (site / "kiln" / "configs").is_symlink()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    # The checkout's editable install must not win over the installed copy.
    where = run("-c", "import kiln; print(kiln.__file__)", cwd=elsewhere, env=env)
    assert Path(where.stdout.strip()).is_relative_to(site)

    # The recipe's corpus (data/pretrain) is not here, and `kiln check` runs the start-up checks:
    # the built-in corpus, built on the first start, stands in for it.
    check = run(
        *("-m", "kiln", "check", "configs/train/7b.toml", "--world-size", "4"),
        "--data.source=demo",
        cwd=elsewhere,
        env=env,
    )
    assert 'preset = "llama3_7b"' in check.stdout
    assert "dim = 4096" in check.stdout  # the preset, read from the installed package
    assert "# world size 4: dp_replicate=1 × dp_shard=4" in check.stdout
    assert "# config OK" in check.stdout
    assert f"shipped with kiln: {site}" in check.stderr
