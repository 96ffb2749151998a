"""A checkpoint whose expert count differs from the model's is refused with one message before
anything is built or loaded, even under checkpoint.resume = 'force': the stacked expert weights
(experts × …) of another count cannot load, whatever the layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kiln.parallel.apply
from kiln.checkpoint.fingerprint import run_fingerprint
from kiln.checkpoint.manager import CheckpointManager, StartKind
from kiln.config import JobConfig, ModelConfig, MoEConfig
from kiln.errors import ConfigError
from kiln.events import EventLog
from tests.unit.test_trainer import make_trainer


def _job(tmp_path, num_experts: int, resume: str = "auto", lr: float = 3e-4) -> JobConfig:
    cfg = JobConfig(model=ModelConfig(moe=MoEConfig(num_experts=num_experts)))
    cfg.metrics.run_dir = str(tmp_path / "run")
    cfg.checkpoint.resume = resume
    cfg.optimizer.lr = lr
    return cfg


def _fake_checkpoint(tmp_path, fingerprint: dict) -> None:
    """A committed step folder holding only its train state: no weights to load, so a start that
    got past the checks would still load nothing."""
    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "train_state.json").write_text(json.dumps({"step": 4, "fingerprint": fingerprint}))
    (step / "COMPLETE").write_text(json.dumps({"step": 4}))


def _start(cfg: JobConfig):
    manager = CheckpointManager(
        cfg, device=torch.device("cpu"), events=EventLog(Path(cfg.metrics.run_dir), enabled=False)
    )
    return manager.start_point(run_fingerprint(cfg, global_batch=8))


@pytest.mark.parametrize("resume", ["auto", "force"])
def test_another_expert_count_is_refused_even_when_forced(tmp_path, resume):
    _fake_checkpoint(tmp_path, run_fingerprint(_job(tmp_path, 8), global_batch=8))
    with pytest.raises(ConfigError) as info:
        _start(_job(tmp_path, 4, resume))
    message = str(info.value)
    assert (
        "step_00000004 holds a model with 8 experts per MoE block (model.moe.num_experts = 8)"
        in (message)
    )
    assert "but this model has 4: expert counts cannot change on resume" in message
    assert "not even with checkpoint.resume = 'force'" in message
    assert "Set model.moe.num_experts = 8 to continue this run, or start a new run" in message
    # One message: the other fingerprint changes are not listed beside it.
    assert "->" not in message


def test_dense_and_moe_checkpoints_do_not_swap(tmp_path):
    _fake_checkpoint(tmp_path, run_fingerprint(_job(tmp_path, 0), global_batch=8))
    with pytest.raises(
        ConfigError, match=r"holds a dense model \(model.moe.num_experts = 0\), but "
    ):
        _start(_job(tmp_path, 8, "force"))


def test_a_dense_model_resumed_as_dense_says_nothing_of_experts(tmp_path):
    _fake_checkpoint(tmp_path, run_fingerprint(_job(tmp_path, 0), global_batch=8))
    with pytest.raises(ConfigError, match=r"optimizer\.lr") as info:
        _start(_job(tmp_path, 0, lr=1e-3))
    assert "experts" not in str(info.value)


def test_the_same_expert_count_leaves_force_as_it_was(tmp_path, capsys):
    _fake_checkpoint(tmp_path, run_fingerprint(_job(tmp_path, 8), global_batch=8))
    with pytest.raises(ConfigError, match=r"optimizer.lr: 0.0003 -> 0.001.*resume=force"):
        _start(_job(tmp_path, 8, lr=1e-3))
    start = _start(_job(tmp_path, 8, "force", lr=1e-3))
    assert start.kind is StartKind.RESUME and start.step == 4
    assert "optimizer.lr" in capsys.readouterr().err


def test_a_fingerprint_without_the_expert_count_is_not_refused_for_it(tmp_path):
    """A checkpoint of a kiln older than the key: nothing to compare, the usual rules apply."""
    saved = run_fingerprint(_job(tmp_path, 8), global_batch=8)
    del saved["model.moe.num_experts"]
    _fake_checkpoint(tmp_path, saved)
    assert _start(_job(tmp_path, 4, "force")).kind is StartKind.RESUME


def test_a_trainer_refuses_before_building_the_model(debug_overrides, monkeypatch):
    moe = [*debug_overrides, "--model.preset=debug_moe", "--data.num_workers=0"]
    trainer = make_trainer(moe, "--train.max_steps=8")
    trainer.train_step()
    trainer.save()

    def no_model(*_args, **_kwargs):
        raise AssertionError("the model was built before the expert count was checked")

    monkeypatch.setattr(kiln.parallel.apply, "build_model", no_model)
    with pytest.raises(ConfigError, match=r"8 experts per MoE block.*but this model has 4"):
        make_trainer(
            moe, "--train.max_steps=8", "--model.moe.num_experts=4", "--checkpoint.resume=force"
        )
