"""Parity (DESIGN §5): every data-parallel layout reproduces one process, step by step.

Real `torchrun` jobs on CPU with gloo, fp32, the debug model, 10 steps, the same global batch of
8 sequences. Gradient clipping at 0.5 is active most steps, so the clipped update is compared too.
"""

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import DEBUG_CONFIG

STEPS = 10
GLOBAL_BATCH = 8
TOLERANCE = 1e-5


def train_args(run_dir, demo_data, *overrides, steps=STEPS):
    """`kiln train` arguments shared by every parity run."""
    args = [
        DEBUG_CONFIG,
        f"--data.path={demo_data}",
        f"--metrics.run_dir={run_dir}",
        f"--train.max_steps={steps}",
        "--metrics.log_interval=1",
        "--train.grad_clip_norm=0.5",
        "--checkpoint.interval=5",
        "--checkpoint.save_final=false",
        *overrides,
    ]
    return [*map(str, args)]


def train(tmp_path, name, demo_data, nproc, *overrides, steps=STEPS):
    run_dir = tmp_path / name
    args = train_args(run_dir, demo_data, *overrides, steps=steps)
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        if nproc > 1
        else []
    )
    command = [sys.executable, *launcher, "-m", "kiln", "train", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


def _env():
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}


def records(run_dir):
    return {
        r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }


def assert_parity(got, expected, steps=range(1, STEPS + 1)):
    for step in steps:
        for key in ("loss", "grad_norm"):
            a, b = got[step][key], expected[step][key]
            assert abs(a - b) <= TOLERANCE * abs(b), f"step {step} {key}: {a} vs one process {b}"


@pytest.fixture(scope="module")
def references(tmp_path_factory, demo_data):
    """One-process runs, one per model variant, computed on first use."""
    cache = {}

    def get(*model_overrides):
        if model_overrides not in cache:
            base = tmp_path_factory.mktemp("reference")
            overrides = [f"--train.batch_size={GLOBAL_BATCH}", *model_overrides]
            cache[model_overrides] = records(train(base, "one", demo_data, 1, *overrides))
        return cache[model_overrides]

    return get


@pytest.fixture(scope="module")
def reference(references):
    return references()


KV4 = ("--model.n_kv_heads=4",)  # tp=4 needs the KV heads to split four ways
TIED = ("--model.tie_embeddings=true",)

LAYOUTS = {
    "dp_shard=2": (2, ["--distributed.dp_shard=2", "--train.batch_size=4"], ()),
    "dp_shard=4": (4, ["--distributed.dp_shard=4", "--train.batch_size=2"], ()),
    "dp_shard=8": (8, ["--distributed.dp_shard=8", "--train.batch_size=1"], ()),
    "dp_replicate=2 x dp_shard=2": (
        4,
        ["--distributed.dp_replicate=2", "--distributed.dp_shard=2", "--train.batch_size=2"],
        (),
    ),
    "dp_shard=2, full AC": (
        2,
        ["--train.batch_size=4", "--train.activation_checkpointing=full"],
        (),
    ),
    "dp_replicate=2 x dp_shard=2, selective AC": (
        4,
        [
            "--distributed.dp_replicate=2",
            "--train.batch_size=2",
            "--train.activation_checkpointing=selective",
        ],
        (),
    ),
    "dp=4/accum=1": (4, ["--train.batch_size=2", "--train.grad_accum_steps=1"], ()),
    "dp=2/accum=2": (2, ["--train.batch_size=2", "--train.grad_accum_steps=2"], ()),
    "dp=1/accum=4": (1, ["--train.batch_size=2", "--train.grad_accum_steps=4"], ()),
    "dp=2/accum=2, one reduce per step": (
        2,
        [
            "--train.batch_size=2",
            "--train.grad_accum_steps=2",
            "--distributed.grad_reduce=per_step",
        ],
        (),
    ),
    "dp_shard=2, compiled blocks": (2, ["--train.batch_size=4", "--train.compile=true"], ()),
    "tp=2": (2, ["--distributed.tp=2", "--train.batch_size=8"], ()),
    "tp=4": (4, ["--distributed.tp=4", "--train.batch_size=8"], KV4),
    "tp=2, tied embeddings": (2, ["--distributed.tp=2", "--train.batch_size=8"], TIED),
    "tp=2 x dp_shard=2": (4, ["--distributed.tp=2", "--train.batch_size=4"], ()),
    "tp=2 x dp_shard=2, full AC": (
        4,
        ["--distributed.tp=2", "--train.batch_size=4", "--train.activation_checkpointing=full"],
        (),
    ),
    "tp=2 x dp_replicate=2 x dp_shard=2": (
        8,
        ["--distributed.tp=2", "--distributed.dp_replicate=2", "--train.batch_size=2"],
        (),
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_layout_matches_one_process(layout, references, tmp_path, demo_data):
    nproc, overrides, model = LAYOUTS[layout]
    got = records(train(tmp_path, "run", demo_data, nproc, *overrides, *model))
    assert_parity(got, references(*model))


def test_checkpoint_from_one_layout_resumes_in_another(reference, tmp_path, demo_data):
    """Save under FSDP on 4 ranks, resume in one process: the rest of the run still matches."""
    sharded = train(tmp_path, "run", demo_data, 4, "--train.batch_size=2")
    checkpoints = sharded / "checkpoints"
    shutil.rmtree(checkpoints / "step_00000010")
    (checkpoints / "latest").unlink()
    resumed = train(tmp_path, "run", demo_data, 1, f"--train.batch_size={GLOBAL_BATCH}")
    assert resumed == sharded
    assert_parity(records(resumed), reference, steps=range(6, STEPS + 1))


def test_two_node_job_on_one_machine(reference, tmp_path, demo_data):
    """Two torchrun agents (`--nnodes 2`) rendezvous on 127.0.0.1 and train as one job."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    args = train_args(run_dir, demo_data, "--train.batch_size=4")
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=kiln-two-nodes",
                "-m",
                "kiln",
                "train",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
        )
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), "\n".join(o[-3000:] for o in outputs)
    assert_parity(records(run_dir), reference)
