"""Loss-spike skipping (`resilience.spike_action = "skip"`) through the training loop: a spike
injected test-side (the gradient norm a step reports, multiplied) is skipped at exactly its step,
changes nothing, is an event; a resume inside the window decides alike (the history travels in
the checkpoint); spikes in a row stop the run as the NaN guard does; bad keys are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kiln.train.step
from kiln.config import load_config
from kiln.config.validate import collect_problems
from kiln.errors import KilnError
from kiln.events import read_events
from tests.unit.test_trainer import make_trainer

STEPS = 16
SPIKES = ["--resilience.spike_action=skip", "--resilience.spike_window=10"]


@pytest.fixture
def spike_at(monkeypatch):
    """`spike_at(steps)`: those steps report a gradient norm 1000 times the true one (the update
    itself was clipped by the true norm, and is skipped)."""
    current, chosen = [0], set()
    call, clip = kiln.train.step.TrainStep.__call__, kiln.train.step.clip_grad_norm

    def calling(self, batch, *, step, flags):
        current[0] = step
        return call(self, batch, step=step, flags=flags)

    def clipping(*args, **kwargs):
        norm = clip(*args, **kwargs)
        return norm * 1000 if current[0] in chosen else norm

    monkeypatch.setattr(kiln.train.step.TrainStep, "__call__", calling)
    monkeypatch.setattr(kiln.train.step, "clip_grad_norm", clipping)
    return chosen.update


def _run(overrides, run_dir: Path, *extra: str):
    trainer = make_trainer(
        overrides,
        *SPIKES,
        f"--metrics.run_dir={run_dir}",
        f"--train.max_steps={STEPS}",
        "--checkpoint.interval=4",
        "--metrics.log_interval=1",
        *extra,
    )
    trainer.train()
    return trainer


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_a_spike_is_skipped_at_its_step_and_a_resume_decides_alike(
    debug_overrides, tmp_path, spike_at
):
    spike_at({13})
    whole = _run(debug_overrides, tmp_path / "whole")
    skips = [e for e in read_events(tmp_path / "whole") if e["event"] == "spike_skip"]
    assert [e["step"] for e in skips] == [13]
    assert [c["metric"] for c in skips[0]["crossed"]] == ["grad_norm"]
    # Changed nothing: 15 updates of 16 steps in AdamW's count.
    optimizer = whole.optimizers[0][0]
    assert {int(s["step"]) for s in optimizer.state.values()} == {STEPS - 1}
    # Stopped at 10 and resumed: step 13 is judged by a window of steps 3-12, 3-10 of which the
    # checkpoint carried. The same operations on the same values: bitwise.
    resumed = tmp_path / "resumed"
    _run(debug_overrides, resumed, "--train.stop_at_step=10")
    _run(debug_overrides, resumed)
    assert _losses(resumed) == _losses(tmp_path / "whole")
    assert [e["step"] for e in read_events(resumed) if e["event"] == "spike_skip"] == [13]


def test_spikes_in_a_row_stop_the_run(debug_overrides, tmp_path, spike_at):
    spike_at({12, 13})
    with pytest.raises(KilnError, match="2 steps in a row up to step 13 were loss spikes"):
        _run(debug_overrides, tmp_path / "run", "--resilience.spike_max_consecutive=2")


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("spike_window=5", "resilience.spike_window = 5 is too short"),
        ("spike_loss_sigmas=0", "resilience.spike_loss_sigmas = 0.0 must be > 0"),
        ("spike_grad_norm_sigmas=-1", "resilience.spike_grad_norm_sigmas = -1.0 must be > 0"),
        ("spike_max_consecutive=0", "resilience.spike_max_consecutive must be >= 1"),
    ],
)
def test_bad_spike_settings_are_refused(debug_overrides, key, message):
    cfg = load_config(
        "configs/train/debug.toml", [*debug_overrides, *SPIKES, f"--resilience.{key}"]
    )
    assert any(message in problem for problem in collect_problems(cfg, world_size=1))
