"""TensorBoard, Weights & Biases (offline) and the profiler as a run writes them, read back with
TensorBoard's own reader and W&B's record format and compared with metrics.jsonl."""

import json
import shutil
import socket

import numpy as np
import pytest

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kiln.cli import main
from kiln.config import load_config
from kiln.config.validate import collect_problems
from kiln.errors import ConfigError
from kiln.metrics.backends import WANDB_ID_FILE, WandbBackend
from kiln.metrics.logger import read_metrics, scalars
from tests.conftest import DEBUG_CONFIG, REPO
from tests.wandb_records import config, history

MOE = REPO / "configs" / "train" / "debug_moe.toml"
BACKENDS = ("--metrics.tensorboard=true", "--metrics.wandb=true", "--metrics.wandb_mode=offline")


def train(recipe, run_dir, demo_data, *overrides):
    args = [
        str(recipe),
        f"--data.path={demo_data}",
        f"--metrics.run_dir={run_dir}",
        "--metrics.log_interval=1",
        "--metrics.plot=false",
        "--train.seq_len=64",
        "--train.max_steps=4",
        "--data.num_workers=0",
        *overrides,
    ]
    assert main(["train", *args]) == 0


def all_written() -> None:
    """W&B's service process writes the run files: stopped, it has written all it holds. A
    fresh-clone run once read a file with no history row right after `finish()` returned."""
    import wandb

    wandb.teardown()


def tensorboard_scalars(log_dir) -> dict[int, dict[str, float]]:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    steps: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            assert tag not in steps.setdefault(event.step, {}), f"{tag} twice at {event.step}"
            steps[event.step][tag] = event.value
    return steps, events


def test_backends_hold_what_metrics_jsonl_holds_across_a_resume(tmp_path, demo_data):
    """An MoE run (per-layer expert loads: lists) with both backends, interrupted after step 4
    with its newest checkpoint at step 2: the resumed job logs steps 3 and 4 again into the same
    TensorBoard directory and W&B run id."""
    run = tmp_path / "run"
    train(MOE, run, demo_data, *BACKENDS, "--checkpoint.interval=2")
    checkpoints = run / "checkpoints"
    shutil.rmtree(checkpoints / "step_00000004")  # as if the job died before that save
    (checkpoints / "latest").write_text("step_00000002\n")
    train(MOE, run, demo_data, *BACKENDS, "--checkpoint.interval=2")

    expected = {r["step"]: scalars(r) for r in read_metrics(run / "metrics.jsonl")}
    assert sorted(expected) == [1, 2, 3, 4]
    assert any(name.startswith("moe/") and name[-1].isdigit() for name in expected[1])

    logged, events = tensorboard_scalars(run / "tensorboard")
    assert sorted(logged) == [1, 2, 3, 4]  # steps 3 and 4 once: the resumed run's
    for step, values in expected.items():
        assert logged[step] == {k: np.float32(v) for k, v in values.items()}, step
    text = events.Tensors("config/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert 'preset = "debug_moe"' in text

    run_id = (run / WANDB_ID_FILE).read_text().strip()
    all_written()
    files = sorted(run.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2  # both attempts, one run id
    # Told apart by their first step, not by their folders' names: W&B names a folder by the
    # second the attempt started, and a second attempt in the same second gets `<name>-1`,
    # which sorts before `<name>/` (a failure seen in a fresh-clone run).
    first, resumed = sorted((history(f) for f in files), key=min)
    assert {**first, **resumed} == expected and sorted(resumed) == [3, 4]
    assert config(files[0])["model"]["moe"]["num_experts"] == 8


def test_wandb_online_without_a_network_warns_once_and_logs_offline(tmp_path, monkeypatch, capfd):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    cfg = load_config(DEBUG_CONFIG, [f"--metrics.run_dir={tmp_path}", "--metrics.wandb=true"])
    backend = WandbBackend(tmp_path, cfg)
    backend.log(1, {"loss": 2.5})
    backend.close()
    err = capfd.readouterr().err
    assert err.count("W&B cannot log online") == 1 and "unreachable" in err, err
    all_written()
    (offline,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    assert history(offline) == {1: {"loss": 2.5}}


def test_the_profiler_traces_the_chosen_steps_with_kiln_phases(tmp_path, demo_data):
    run = tmp_path / "run"
    profiling = [
        "--profiling.enabled=true",
        "--profiling.start_step=2",
        "--profiling.end_step=3",
        "--profiling.record_memory=true",
        "--checkpoint.interval=3",
        "--scheduler.warmup_steps=1",
    ]
    train(DEBUG_CONFIG, run, demo_data, *profiling)
    (trace,) = (run / "profile" / "rank_0").glob("*.json")
    assert trace.name == "steps_2-3.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert {"data", "forward", "backward", "optimizer", "checkpoint"} <= names
    assert any(event.get("name") == "[memory]" for event in events)  # record_memory on a CPU


def test_bad_observability_settings_are_named(monkeypatch):
    cfg = load_config(
        DEBUG_CONFIG,
        [
            "--train.max_steps=20",
            "--profiling.enabled=true",
            "--profiling.start_step=5",
            "--profiling.end_step=50",
            "--profiling.ranks=[0, 3]",
        ],
    )
    problems = collect_problems(cfg, 2)
    assert any(
        "profiling steps 5..50 are not a range inside this run (steps 1..20)" in p for p in problems
    )
    assert any("profiling.ranks [3] are not ranks of a 2-process job" in p for p in problems)
    # A word outside a Literal key's choices is refused while the config is built.
    with pytest.raises(ConfigError, match=r"metrics\.wandb_mode = 'online-ish' is not one of"):
        load_config(DEBUG_CONFIG, ["--metrics.wandb_mode=online-ish"])
    cfg.metrics.wandb_mode = "online-ish"  # set in Python: validation refuses it
    assert any(
        "metrics.wandb_mode = 'online-ish' is not one of" in p for p in collect_problems(cfg, 2)
    )

    import importlib.util

    real = importlib.util.find_spec
    missing = {"tensorboard", "wandb"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name in missing else real(name)
    )
    both = load_config(DEBUG_CONFIG, ["--metrics.tensorboard=true", "--metrics.wandb=true"])
    problems = collect_problems(both, 1)
    assert any("pip install 'kiln[tb]'" in p for p in problems), problems
    assert any("pip install 'kiln[wandb]'" in p for p in problems), problems
