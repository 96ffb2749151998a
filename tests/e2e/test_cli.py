"""The CLI as a user runs it: real subprocesses, real files."""

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import DEBUG_CONFIG


def kiln(*args, cwd, check=True, timeout=300):
    result = subprocess.run(
        [sys.executable, "-m", "kiln", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"kiln {args} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["train"],
        ["check"],
        ["prepare"],
        ["generate"],
        ["convert"],
        ["convert", "hf-to-kiln"],
        ["convert", "kiln-to-hf"],
        ["plot"],
        ["compare"],
    ],
)
def test_help(command, tmp_path):
    result = kiln(*command, "--help", cwd=tmp_path)
    assert "usage: kiln" in result.stdout
    if command[:1] != ["convert"]:
        assert "Guide: docs/" in result.stdout, result.stdout
    if command == ["prepare"]:  # inputs at a URL, as docs/data.md lists them
        flat = " ".join(result.stdout.split())
        assert all(scheme in flat for scheme in ("https://", "s3://", "gs://")), flat


def test_help_shows_defaults_and_version_is_reported(tmp_path):
    generate = kiln("generate", "--help", cwd=tmp_path).stdout
    assert "(default: 64)" in generate and "(default: auto)" in generate
    assert "(default: None)" not in generate
    assert kiln("--version", cwd=tmp_path).stdout.startswith("kiln ")


def write_run(run_dir, losses, *, tokens_per_step=512):
    run_dir.mkdir(parents=True)
    records = [
        {"step": step, "loss": loss, "loss_avg": loss, "tokens_seen": step * tokens_per_step}
        | ({"eval/loss": loss + 0.1} if step % 2 == 0 else {})
        for step, loss in enumerate(losses, start=1)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_compare_and_plot_read_run_dirs(tmp_path):
    write_run(tmp_path / "adamw", [3.0, 2.5, 2.25, 2.0])
    write_run(tmp_path / "muon", [3.0, 2.4, 2.0, 1.75], tokens_per_step=1024)
    # A fault-tolerance run: each replica group logs in its own folder; group 0's is read.
    write_run(tmp_path / "ft" / "replica_group_0", [3.0, 2.6, 2.2])
    write_run(tmp_path / "ft" / "replica_group_1", [3.0, 2.7])
    result = kiln("compare", "adamw", "muon", "ft", "--out", "both.png", cwd=tmp_path)
    header, first, second, third = result.stdout.splitlines()[:4]
    assert header.split() == [
        "run",
        "steps",
        "tokens",
        "final",
        "loss",
        "min",
        "loss",
        "vs",
        "first",
    ]
    assert first.split() == ["adamw", "4", "2,048", "2", "2"]
    assert second.split() == ["muon", "4", "4,096", "1.75", "1.75", "-0.25"]
    assert third.split() == ["ft/replica_group_0", "3", "1,536", "2.2", "2.2", "+0.2"]
    assert "ft is a fault-tolerance run: reading replica group 0's metrics" in result.stderr
    assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"
    evals = kiln("compare", "adamw", "muon", "--metric", "eval/loss", cwd=tmp_path).stdout
    assert "final eval/loss" in evals and (tmp_path / "compare.png").is_file()

    missing = kiln("compare", "adamw", "--metric", "eval/perplexity", cwd=tmp_path, check=False)
    assert missing.returncode == 2
    assert "adamw logged no 'eval/perplexity'; its metrics are: eval/loss, loss" in missing.stderr

    assert "loss curve" in kiln("plot", "muon", cwd=tmp_path).stdout
    assert (tmp_path / "muon" / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    empty = kiln("plot", ".", cwd=tmp_path, check=False)
    assert empty.returncode == 2 and "is it a kiln run directory?" in empty.stderr


def test_plot_and_compare_pick_a_replica_group(tmp_path, capsys):
    """In-process (no interpreter to start): `--replica-group` chooses a fault-tolerance run's
    group, the curve goes where the run draws it, and a group that did not log is named."""
    from kiln.cli import main

    write_run(tmp_path / "ft" / "replica_group_0", [3.0, 2.6, 2.2])
    write_run(tmp_path / "ft" / "replica_group_1", [3.0, 2.7])
    assert main(["plot", str(tmp_path / "ft"), "--replica-group", "1"]) == 0
    assert (tmp_path / "ft" / "replica_group_1" / "loss_curve.png").is_file()
    assert not (tmp_path / "ft" / "replica_group_0" / "loss_curve.png").exists()
    capsys.readouterr()
    out = tmp_path / "c.png"
    assert main(["compare", str(tmp_path / "ft"), "--replica-group=1", f"--out={out}"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["ft/replica_group_1", "2"]
    assert main(["plot", str(tmp_path / "ft"), "--replica-group", "2"]) == 2
    error = capsys.readouterr().err
    assert "has no replica_group_2/metrics.jsonl (it has groups 0, 1)" in error


def bad_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train\nmax_steps = 3\n")
    return path


BAD_INPUTS = {
    "unknown key": (["check", DEBUG_CONFIG, "--train.batch_sze=3"], "did you mean 'batch_size'"),
    "unknown section": (
        ["check", DEBUG_CONFIG, "--trainer.max_steps=3"],
        "unknown section 'trainer' (did you mean 'train'?)",
    ),
    "wrong type": (
        ["check", DEBUG_CONFIG, "--train.max_steps=many"],
        "train.max_steps: expected an integer, got 'many'",
    ),
    "negative lr": (
        ["train", DEBUG_CONFIG, "--optimizer.lr=-0.1"],
        "optimizer.lr must be positive",
    ),
    "heads vs kv heads": (
        ["train", DEBUG_CONFIG, "--model.n_kv_heads=3"],
        "must be divisible by model.n_kv_heads (3)",
    ),
    "layout vs world size": (
        ["check", DEBUG_CONFIG, "--world-size=8", "--distributed.dp_shard=2", "--distributed.tp=2"],
        "but the world size is 8",
    ),
    "too few pipeline micro-batches": (
        [
            "check",
            DEBUG_CONFIG,
            "--world-size=4",
            "--distributed.pp=4",
            "--model.n_layers=4",
            "--distributed.pp_microbatches=2",
        ],
        "needs at least pp = 4 micro-batches",
    ),
    "more pipeline stages than layers": (
        ["check", DEBUG_CONFIG, "--world-size=4", "--distributed.pp=4"],
        "every stage needs at least one layer",
    ),
    "unknown pipeline schedule": (
        [
            "check",
            DEBUG_CONFIG,
            "--world-size=2",
            "--distributed.pp=2",
            "--distributed.pp_schedule=zero_bubble",
        ],
        "distributed.pp_schedule = 'zero_bubble' is not one of",
    ),
    "toml syntax": ([bad_toml, "--world-size=1"], "TOML syntax error"),
    "missing config": (["train", "nope.toml"], "config file not found: nope.toml"),
    "missing data": (
        ["train", DEBUG_CONFIG, "--data.source=prepared", "--data.path=no/such/data"],
        "no/such/data",
    ),
    "missing tokenizer": (
        ["train", DEBUG_CONFIG, "--data.tokenizer=no/tokenizer.json"],
        "data.tokenizer: no/tokenizer.json not found",
    ),
    "vocabulary bigger than the model's": (
        ["train", DEBUG_CONFIG, "--model.vocab_size=300"],
        "model.vocab_size (300) is smaller than the vocabulary",
    ),
    "phase names an unknown dataset": (
        ["check", DEBUG_CONFIG, "--data.phases=[{start_step = 5, weights = {web = 1.0}}]"],
        "data.phases[0].weights names unknown datasets ['web']",
    ),
    "eval without held-out data": (
        ["train", DEBUG_CONFIG, "--eval.interval=5"],
        "eval.interval is set but there is no held-out data",
    ),
    "run dir is a file": (
        ["train", DEBUG_CONFIG, "--metrics.run_dir=README", "--train.max_steps=6"],
        "README",
    ),
    "not a checkpoint": (["generate", ".", "--prompt=hi"], "is not a kiln checkpoint"),
    "initial weights not a checkpoint": (
        ["train", DEBUG_CONFIG, "--checkpoint.load_path=."],
        "is not a kiln checkpoint",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_gives_one_clear_error(case, tmp_path, demo_data):
    args, expected = BAD_INPUTS[case]
    if args[0] == "train":  # the session corpus, unless the case names other data
        args = [*args[:2], f"--data.path={demo_data}", *args[2:]]
    if callable(args[0]):
        args = ["check", args[0](tmp_path), *args[1:]]
    (tmp_path / "README").write_text("a file where a directory is expected")
    result = kiln(*args, cwd=tmp_path, check=False)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()  # nothing written for a run that never started


def test_train_then_generate(demo_data, tmp_path):
    trained = kiln(
        "train",
        DEBUG_CONFIG,
        f"--data.path={demo_data}",
        "--train.max_steps=6",
        "--metrics.run_dir=run",
        cwd=tmp_path,
    ).stdout
    # The start-up summary, before the first step.
    summary = trained[: trained.index("step 1/6")]
    assert "kiln: model debug: 2 layers" in summary and "kiln: parameters: 1,442,432" in summary
    assert "kiln: run dir run; starts from scratch; 6 steps" in summary
    assert (tmp_path / "run" / "checkpoints" / "step_00000006" / "COMPLETE").is_file()
    out = kiln(
        "generate",
        "run",  # the run directory: its newest checkpoint
        "--prompt",
        "def main(",
        "--max-new-tokens",
        "8",
        cwd=tmp_path,
    ).stdout
    assert out.startswith("def main(")
    sampled = kiln(
        "generate",
        "run/checkpoints/step_00000006",
        "--prompt",
        "import",
        "--temperature",
        "0.8",
        "--top-k",
        "50",
        "--top-p",
        "0.9",
        cwd=tmp_path,
    )
    assert sampled.stdout.startswith("import")


def losses(run_dir):
    return {
        r["step"]: r["loss"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }


def test_killed_run_resumes_bitwise(demo_data, tmp_path):
    """Kill a run after its first checkpoint, run the same command again: same losses as uninterrupted."""
    common = [
        DEBUG_CONFIG,
        f"--data.path={demo_data}",
        "--train.max_steps=12",
        "--metrics.log_interval=1",
        "--checkpoint.interval=4",
    ]
    kiln("train", *common, "--metrics.run_dir=straight", cwd=tmp_path)

    command = [sys.executable, "-m", "kiln", "train", *map(str, common), "--metrics.run_dir=broken"]
    process = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    marker = tmp_path / "broken" / "checkpoints" / "step_00000004" / "COMPLETE"
    deadline = time.monotonic() + 240
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert marker.exists()
    assert not (tmp_path / "broken" / "checkpoints" / "step_00000012").exists(), (
        "the run finished before it was killed"
    )

    resumed = kiln("train", *common, "--metrics.run_dir=broken", cwd=tmp_path)
    assert "resumed from" in resumed.stdout
    assert losses(tmp_path / "broken") == losses(tmp_path / "straight")


def test_pipelined_recipe_check_shows_the_stages(tmp_path):
    recipe = DEBUG_CONFIG.parent / "70b_32gpu_tp4_pp4.toml"
    result = kiln("check", recipe, "--world-size=32", "--config-only", cwd=tmp_path)
    assert "tp=4 × pp=4" in result.stdout
    assert "layers per stage [20, 20, 20, 20], 8 micro-batches" in result.stdout
