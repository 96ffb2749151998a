"""kiln runs on a range of torch releases and refuses an older one with one message."""

import subprocess
import sys

import pytest

from kiln.torch_version import SUPPORTED, torch_version_problem


@pytest.mark.parametrize(
    "version", ["2.11.0+cu130", "2.12.1", "2.13.0", "2.14.0.dev20270101", "local"]
)
def test_supported_newer_and_unparseable_versions_pass(version):
    assert torch_version_problem(version) is None


def test_older_torch_is_refused_naming_the_range():
    problem = torch_version_problem("2.10.0+cu126")
    assert "torch 2.10.0+cu126" in problem and SUPPORTED in problem and "pip install" in problem


def test_importing_kiln_with_an_old_torch_installed_fails_with_the_message(tmp_path):
    # An older torch's metadata first on the path: what `import kiln` reads, without importing torch.
    info = tmp_path / "torch-2.10.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.10.0\n")
    result = subprocess.run(
        [sys.executable, "-c", "import kiln"],
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"ImportError: kiln supports torch {SUPPORTED}; this environment has torch 2.10.0."
        )
    ), result.stderr
