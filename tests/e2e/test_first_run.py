"""What a new user hits first, as the user runs it: errors under torchrun, `kiln check` before a
job is queued."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from kiln.cli import main
from tests.conftest import DEBUG_CONFIG
from tests.eval_tasks import write_checkpoint


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_a_config_error_under_torchrun_is_printed_once_and_every_rank_fails(tmp_path):
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    result = _run(
        *launcher, "-m", "kiln", "train", str(DEBUG_CONFIG), "--train.batch_size=0", cwd=tmp_path
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("train.batch_size must be positive, got 0") == 1, output
    assert "Traceback" not in output.split("train.batch_size must be positive")[0]
    assert not (tmp_path / "runs").exists()  # nothing written


def _check(capsys, *overrides: str) -> tuple[int, str, str]:
    """`kiln check` in this process (the CLI's own entry point), its exit code and output."""
    code = main(["check", str(DEBUG_CONFIG), *overrides])
    out, err = capsys.readouterr()
    return code, out, err


def test_check_reports_what_train_would_refuse_at_start_up(tmp_path, demo_data, capsys):
    """--strict: an error, as `kiln train` gives it at start-up."""
    nowhere = tmp_path / "nowhere"
    missing = ["--data.source=prepared", f"--data.path={nowhere}"]
    code, out, err = _check(capsys, "--strict", *missing)
    assert code == 2 and f"dataset directory not found: {nowhere}" in err
    assert "config OK" not in out
    run = [f"--data.path={demo_data}", f"--metrics.run_dir={tmp_path / 'run'}"]
    code, _, err = _check(capsys, "--strict", *run, "--model.vocab_size=1000")
    assert code == 2 and "model.vocab_size (1000) is smaller than the vocabulary" in err
    code, _, err = _check(capsys, "--strict", *run, f"--checkpoint.load_path={tmp_path / 'none'}")
    assert code == 2 and "checkpoint not found" in err
    code, out, err = _check(capsys, *run)
    assert code == 0, err
    assert "# checkpoints: a new run in" in out and "# config OK" in out
    assert not (tmp_path / "run").exists()  # checking writes nothing


def test_check_warns_of_start_up_problems_without_failing(tmp_path, capsys):
    """`kiln check` judges the recipe and the layout: a dataset not prepared yet is a warning
    that says how to prepare it, and the check passes, as the README's commands expect."""
    nowhere = tmp_path / "nowhere"
    code, out, err = _check(capsys, "--data.source=prepared", f"--data.path={nowhere}")
    assert code == 0, err
    assert f"kiln check: warning: dataset directory not found: {nowhere}" in err
    assert f"kiln prepare --input ... --tokenizer tokenizer.json --output {nowhere}" in err
    assert "# config OK (1 start-up warning: kiln train would refuse to start)" in out


def test_check_names_the_data_it_opened(tmp_path, demo_data, capsys):
    run = [f"--data.path={demo_data}", f"--metrics.run_dir={tmp_path / 'run'}"]
    code, out, err = _check(capsys, *run)
    assert code == 0, err
    assert f"# data ({demo_data}): opened, its vocabulary fits model.vocab_size" in out
    assert "data data" not in out


def test_generate_says_which_step_it_loaded_and_which_it_skipped(tmp_path, capsys):
    """A damaged newest checkpoint is passed over: the user is told, and told which step the
    text comes from."""
    root = write_checkpoint(tmp_path)  # root/step_00000001
    shutil.copytree(root / "step_00000001", root / "step_00000002")
    (root / "step_00000002" / "COMPLETE").write_text("")  # a hard stop before it reached disk
    (root / "latest").write_text("step_00000002")
    args = ["generate", str(root), "--prompt", "the", "--max-new-tokens", "2", "--device", "cpu"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert f"kiln generate: skipping {root / 'step_00000002'}" in err
    assert f"kiln generate: step 1 from {root / 'step_00000001'}" in err
    assert main([*args[:1], str(root / "step_00000001"), *args[2:]]) == 0
    assert capsys.readouterr().err == f"kiln generate: step 1 from {root / 'step_00000001'}\n"


def test_generate_help_shows_the_sampling_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 0.0)", "(default: 0)", "(default: 1.0)"):
        assert default in out
    assert "--seed SEED sampling seed (default: 0)" in out
    assert "--top-k TOP_K sample among the k likeliest tokens (0 = all) (default: 0)" in out
