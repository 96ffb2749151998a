"""What can go wrong around checkpoints on one process: damaged checkpoints, a run
directory of another config, async saves, a full or unwritable disk."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest
import torch

from kiln.checkpoint import load_checkpoint
from kiln.checkpoint.fingerprint import fingerprint_changes, run_fingerprint
from kiln.checkpoint.layout import resume_candidates
from kiln.cli import main
from kiln.config import JobConfig
from kiln.errors import ConfigError, KilnError
from tests.conftest import DEBUG_CONFIG
from tests.unit.test_trainer import make_trainer


def _trainer(overrides, *extra):
    return make_trainer(overrides, "--data.num_workers=0", "--train.max_steps=8", *extra)


def _run_to(trainer, step):
    while trainer.step < step:
        trainer.train_step()


@pytest.fixture
def saved_at_2_and_4(debug_overrides, tmp_path):
    trainer = _trainer(debug_overrides)
    for step in (2, 4):
        _run_to(trainer, step)
        trainer.save()
    return tmp_path / "run" / "checkpoints"


def test_a_truncated_checkpoint_is_skipped_with_a_warning(
    debug_overrides, saved_at_2_and_4, capsys
):
    shard = next((saved_at_2_and_4 / "step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    trainer = _trainer(debug_overrides)
    assert trainer.step == 2
    warning = capsys.readouterr().err
    assert "skipping" in warning and "step_00000004" in warning and shard.name in warning


def test_a_checkpoint_without_its_marker_is_skipped_with_a_warning(
    debug_overrides, saved_at_2_and_4, capsys
):
    (saved_at_2_and_4 / "step_00000004" / "COMPLETE").unlink()
    assert _trainer(debug_overrides).step == 2
    assert "skipping" in (err := capsys.readouterr().err) and "no COMPLETE marker" in err


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(debug_overrides, saved_at_2_and_4):
    for step in (2, 4):
        (saved_at_2_and_4 / f"step_0000000{step}" / "train_state.json").write_text("{}")
    assert resume_candidates(saved_at_2_and_4)[0] is None
    with pytest.raises(KilnError, match="none is intact"):
        _trainer(debug_overrides)


def test_another_global_batch_is_refused_with_the_settings_that_keep_it(
    debug_overrides, saved_at_2_and_4
):
    """Resuming on more data ranks (here: more accumulation) changes the global batch: the
    refusal names the batch size or accumulation that keeps the run's."""
    with pytest.raises(ConfigError) as refused:
        _trainer(debug_overrides, "--train.grad_accum_steps=2")
    message = str(refused.value)
    assert "train.global_batch: 4 -> 8" in message
    assert "4 sequences in the checkpoint, 4 × 2 × 1 = 8 here" in message
    assert "--train.batch_size=2 or --train.grad_accum_steps=1" in message


def test_a_different_config_is_refused_unless_forced(debug_overrides, saved_at_2_and_4, capsys):
    with pytest.raises(ConfigError, match=r"optimizer.lr: 0.003 -> 0.001.*resume=force"):
        _trainer(debug_overrides, "--optimizer.lr=1e-3")
    forced = _trainer(debug_overrides, "--optimizer.lr=1e-3", "--checkpoint.resume=force")
    assert forced.step == 4 and "optimizer.lr" in capsys.readouterr().err
    # Where an invocation stops and the checkpoint settings are not part of the run's identity.
    stops = ["--train.stop_at_step=6", "--train.time_limit_minutes=60"]
    assert _trainer(debug_overrides, *stops, "--checkpoint.keep_last_n=1").step == 4


def test_a_new_horizon_is_refused_for_a_decaying_schedule(debug_overrides, saved_at_2_and_4):
    """max_steps shapes the cosine schedule of the steps already taken: a change is refused with
    the reason and the options that do not touch the schedule."""
    with pytest.raises(ConfigError, match=r"train.max_steps: 8 -> 20.*horizon.*stop_at_step"):
        _trainer(debug_overrides, "--train.max_steps=20")
    assert _trainer(debug_overrides, "--train.max_steps=20", "--checkpoint.resume=force").step == 4


def test_the_horizon_is_free_under_a_flat_schedule():
    cfg = JobConfig()
    cfg.scheduler.name = "constant"
    flat = run_fingerprint(cfg, global_batch=8)
    cfg.train.max_steps += 100
    assert fingerprint_changes(flat, run_fingerprint(cfg, global_batch=8)) == []
    cfg.scheduler.name = "cosine"
    assert "train.max_steps" in run_fingerprint(cfg, global_batch=8)


def test_stop_at_step_before_the_resume_point_is_refused(debug_overrides, saved_at_2_and_4):
    with pytest.raises(ConfigError, match=r"stop_at_step = 3 but this run resumes at step 4"):
        _trainer(debug_overrides, "--train.stop_at_step=3")


def test_async_save_writes_what_the_step_held(debug_overrides, tmp_path):
    trainer = _trainer(debug_overrides, "--checkpoint.async_mode='async'")
    _run_to(trainer, 3)
    expected = {k: v.clone() for k, v in trainer.model_parts[0].state_dict().items()}
    trainer.save()
    trainer.train_step()  # changes the weights while the write may still run
    trainer.checkpoints.close(after_step=trainer.step)
    reloaded = _trainer(debug_overrides)
    reloaded_state = reloaded.model_parts[0].state_dict()
    assert reloaded.step == 3
    assert all(torch.equal(reloaded_state[k], v) for k, v in expected.items())


def test_model_only_false_needs_optimizer_state(debug_overrides, saved_at_2_and_4, tmp_path):
    warm = [f"--checkpoint.load_path={saved_at_2_and_4}", "--checkpoint.model_only=false"]
    fork = _trainer([*debug_overrides[:1], f"--metrics.run_dir={tmp_path / 'fork'}"], *warm)
    assert fork.step == 4  # the whole training state, continued in a new run directory
    model = fork.model_parts[0]
    state = load_checkpoint(saved_at_2_and_4, model=model)
    assert state["step"] == 4


def test_a_warm_start_under_other_model_settings_is_refused(
    debug_overrides, saved_at_2_and_4, tmp_path
):
    """Same shapes, other math (a converted Llama 3.1 model without its RoPE scaling would load
    cleanly): refused, naming each setting."""
    warm = [
        f"--checkpoint.load_path={saved_at_2_and_4}",
        "--metrics.run_dir=" + str(tmp_path / "w"),
    ]
    with pytest.raises(ConfigError, match=r"model.rope_theta: 500000.0 in the checkpoint, 10000.0"):
        _trainer(debug_overrides[:1], *warm, "--model.rope_theta=10000.0")
    assert _trainer(debug_overrides[:1], *warm, "--model.max_seq_len=512").step == 0


def _train_cli(*args, limit_bytes=None, cwd):
    def limit():  # a "full disk": no file may grow past limit_bytes
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run(
        [sys.executable, "-m", "kiln", "train", str(DEBUG_CONFIG), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        preexec_fn=limit if limit_bytes else None,
    )


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_full_disk_is_one_clear_error_and_keeps_the_previous_checkpoint(
    demo_data, tmp_path, monkeypatch, mode
):
    common = [
        f"--data.path={demo_data}",
        "--metrics.run_dir=run",
        "--checkpoint.interval=2",
        "--scheduler.warmup_steps=1",
        "--data.num_workers=0",
        f"--checkpoint.async_mode='{mode}'",
        "--train.max_steps=4",
    ]
    # The first part needs no disk limit: run in this process rather than a new one.
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(DEBUG_CONFIG), *common, "--train.stop_at_step=2"]) == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    before = {p.name: p.stat().st_size for p in (checkpoints / "step_00000002").iterdir()}

    full = _train_cli(*common, limit_bytes=1_000_000, cwd=tmp_path)
    assert full.returncode == 2
    assert "could not write the checkpoint of step 4" in full.stderr
    assert "step_00000002 is intact" in full.stderr and "Traceback" not in full.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000002"]
    assert (checkpoints / "latest").read_text().strip() == "step_00000002"
    after = {p.name: p.stat().st_size for p in (checkpoints / "step_00000002").iterdir()}
    assert after == before
    assert resume_candidates(checkpoints)[0] == checkpoints / "step_00000002"


def test_an_unwritable_checkpoint_dir_fails_at_start(demo_data, tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    result = _train_cli(
        f"--data.path={demo_data}",
        "--metrics.run_dir=run",
        f"--checkpoint.dir={tmp_path / 'a_file' / 'checkpoints'}",
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "is not writable" in result.stderr and "checkpoint.dir" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_checkpoint_marker_lists_every_file(saved_at_2_and_4):
    manifest = json.loads((saved_at_2_and_4 / "step_00000004" / "COMPLETE").read_text())
    assert manifest["step"] == 4
    assert {"train_state.json", "config.toml", ".metadata", "rng/rank_00000.pt"} <= set(
        manifest["files"]
    )


def test_rollback_and_retention_pass_over_the_damaged_checkpoint_a_resume_skipped(
    debug_overrides, saved_at_2_and_4, capsys
):
    """Step 4 lost a file: the resume falls back to step 2, and so must everything after it
    that looks for "the newest checkpoint". A NaN at step 3 rolls back to step 2 (not to step 4,
    which `latest` still names), and keep_last_n = 2 counts intact checkpoints only."""
    (saved_at_2_and_4 / "step_00000004" / "rng" / "rank_00000.pt").unlink()
    trainer = _trainer(
        debug_overrides,
        "--train.stop_at_step=6",
        "--checkpoint.interval=3",
        "--checkpoint.keep_last_n=2",
        "--resilience.debug_nan_steps=[3]",
        "--resilience.nan_max_consecutive=1",
        "--resilience.nan_action='rollback'",
    )
    assert trainer.step == 2
    trainer.train()
    assert "rolled back from step 3 to" in capsys.readouterr().err
    events = [json.loads(line) for line in (saved_at_2_and_4.parent / "events.jsonl").open()]
    (rollback,) = [e for e in events if e["event"] == "rollback"]
    assert rollback["path"] == str(saved_at_2_and_4 / "step_00000002")
    # Intact 6 and 3 are the two kept; the damaged 4 between them is not counted and stays.
    kept = sorted(p.name for p in saved_at_2_and_4.glob("step_*"))
    assert kept == ["step_00000003", "step_00000004", "step_00000006"]
    assert resume_candidates(saved_at_2_and_4)[0] == saved_at_2_and_4 / "step_00000006"


def test_a_run_whose_location_was_taken_over_stops_writing(debug_overrides, tmp_path):
    """A run that stalled past its lease's expiry finds another run holding its location: its
    next save stops before writing anything, naming the new owner."""
    trainer = _trainer(debug_overrides, "--train.max_steps=8")
    trainer.train_step()
    checkpoints = tmp_path / "run" / "checkpoints"
    newcomer = {
        "run": "newcomer",
        "host": "elsewhere",
        "pid": 7,
        "run_dir": "/r",
        "heartbeat": 1e12,
    }
    (checkpoints / "OWNER").write_text(json.dumps(newcomer))
    with pytest.raises(KilnError, match="was taken over by run newcomer"):
        trainer.save()
    assert not list(checkpoints.glob("*step_*"))  # nothing written, nothing removed
