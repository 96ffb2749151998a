"""Checkpoints in an object store, against a real S3 server (moto's, on the loopback interface):
an async save through the training loop resumes bit for bit, retention deletes old steps, a
save without its marker or with a file of the wrong size is skipped, and each way of failing to
reach the bucket is one message before the first step. `kiln eval` scores a checkpoint there."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid

import pytest

import kiln.checkpoint.store
from kiln.checkpoint import layout
from kiln.checkpoint.lease import Lease
from kiln.checkpoint.store import location, store_for
from kiln.cli import main
from kiln.errors import KilnError
from kiln.metrics.logger import read_metrics
from tests.conftest import DEBUG_CONFIG
from tests.support.servers import http_server, make_bucket
from tests.unit.test_trainer import make_trainer

# Four steps of the debug model at seq_len 64: the cosine warmup must end before max_steps.
SHORT = ["--train.max_steps=4", "--scheduler.warmup_steps=1", "--train.seq_len=64"]


@pytest.fixture
def bucket(s3_env, s3_endpoint) -> str:
    """A fresh bucket on the session's S3 server, this process pointed at it."""
    name = f"kiln-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, name)
    return name


@pytest.fixture
def fresh_store(monkeypatch):
    """Stores opened by this test read the environment it sets (kiln opens one per protocol per
    process, as a long-lived job would)."""
    monkeypatch.setattr(kiln.checkpoint.store, "_OBJECT_STORES", {})


def _keys(bucket: str) -> list[str]:
    fs = store_for(location(f"s3://{bucket}")).fs
    return sorted(name.removeprefix(f"{bucket}/") for name in fs.find(bucket))


def _losses(run_dir) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_an_async_save_to_s3_resumes_bitwise_past_an_interrupted_one(
    debug_overrides, demo_data, tmp_path, bucket, monkeypatch
):
    """The run reads its data over HTTP (prepared data at a URL); `kiln eval` then scores its
    checkpoint in S3 on the run's own held-out data at that URL."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # remote tokenizer copies
    with http_server(demo_data.parent, ranges=True) as base:
        data = f"{base}/{demo_data.name}"
        run = [
            *SHORT,
            f"--data.path={data}",
            "--data.source=prepared",
            f"--eval.path={data}",
            "--eval.interval=4",
            "--eval.steps=2",
            f"--checkpoint.dir=s3://{bucket}/run",
            "--checkpoint.async_mode=async",
            "--checkpoint.interval=2",
            "--metrics.log_interval=1",
        ]
        make_trainer(debug_overrides, *run).train()  # saves at steps 2 and 4, in the background
        expected = _losses(tmp_path / "run")
        root = location(f"s3://{bucket}/run")
        store = store_for(root)
        # A crash between the last object of step 4 and its marker: an interrupted save.
        store.fs.rm_file(str(root / "step_00000004" / "COMPLETE"))

        resumed = make_trainer(debug_overrides, *run, "--checkpoint.keep_last_n=1")
        assert resumed.step == 2
        resumed.train()
        losses = _losses(tmp_path / "run")
        # Bitwise: the same arithmetic on the same machine, from the state read back from S3.
        assert [losses[3], losses[4]] == [expected[3], expected[4]]

        out = tmp_path / "eval.json"
        assert main(["eval", f"s3://{bucket}/run", "--steps=2", f"--json={out}"]) == 0
        scored = json.loads(out.read_text())
        assert (scored["step"], scored["data"]) == (4, [data])
        records = read_metrics(tmp_path / "run" / "metrics.jsonl")
        logged = [r for r in records if "eval/loss" in r][-1]
        # Bitwise: the trainer's own evaluation, on the weights of step 4 read back from S3.
        assert (logged["step"], scored["eval/loss"]) == (4, logged["eval/loss"])

    keys = _keys(bucket)
    assert not [key for key in keys if key.startswith("run/step_00000002/")]  # keep_last_n = 1
    step = {key.removeprefix("run/step_00000004/") for key in keys if "step_00000004/" in key}
    assert {"COMPLETE", ".metadata", "__0_0.distcp", "rng/rank_00000.pt", "config.toml"} <= step
    assert store.read_bytes(root / "latest") == b"step_00000004\n"
    manifest = json.loads(store.read_bytes(root / "step_00000004" / "COMPLETE"))
    assert set(manifest["files"]) == step - {"COMPLETE"}


def _stage(root, step: int, distcp: bytes = b"x" * 100) -> None:
    """The objects of a save of `step` before its commit (as saver writes them)."""
    staged = layout.partial_dir(root, step)
    store = store_for(root)
    store.write_bytes(staged / "train_state.json", json.dumps({"step": step}).encode())
    store.write_bytes(staged / "__0_0.distcp", distcp)


def test_an_interrupted_or_damaged_save_in_s3_is_skipped_and_cleared(bucket):
    root = location(f"s3://{bucket}/run")
    store = store_for(root)
    for step in (2, 4, 6):
        _stage(root, step)
        layout.commit(root, step, written=["train_state.json", "__0_0.distcp"])
    # The manifest holds what the writers reported, not whatever a listing of the prefix shows.
    store.write_bytes(root / "step_00000002" / "stray", b"not written by this save")
    assert set(layout.read_manifest(root / "step_00000002")) == {"train_state.json", "__0_0.distcp"}
    store.write_bytes(root / "step_00000006" / "__0_0.distcp", b"x" * 10)  # replaced, shorter
    _stage(root, 8)  # the save died before its marker

    newest, skipped = layout.resume_candidates(root)
    assert newest == root / "step_00000004"
    assert [(s.path.name, s.reason.split(";")[0]) for s in skipped] == [
        ("step_00000008", "an interrupted save (no COMPLETE marker)"),
        ("step_00000006", "__0_0.distcp has 10 bytes, 100 were written"),
    ]
    with pytest.raises(KilnError, match="incomplete checkpoint"):
        layout.resolve_checkpoint(root / "step_00000008")

    layout.remove_partials(root)  # what the next save does first
    layout.prune(root, 1, keep=root / "step_00000006")
    assert _keys(bucket) == ["run/latest", *(f"run/step_00000006/{n}" for n in _STEP_FILES)]


_STEP_FILES = ("COMPLETE", "__0_0.distcp", "train_state.json")


def test_kiln_eval_of_a_bucket_without_a_complete_checkpoint_is_one_message(bucket, capsys):
    root = location(f"s3://{bucket}/run")
    _stage(root, 2)  # a save that died before its marker
    before = _keys(bucket)
    errors = {}
    for url in (root, root / "step_00000002", location(f"s3://{bucket}/nothing")):
        assert main(["eval", str(url)]) == 2
        errors[url.name] = err = capsys.readouterr().err
        assert err.count("error:") == 1 and str(url) in err and "Traceback" not in err, err
    assert "an incomplete checkpoint (no COMPLETE marker)" in errors["step_00000002"]
    assert "use an earlier step" in errors["step_00000002"]
    assert (
        "holds no complete checkpoint yet" in errors["run"]
        and "after a save commits" in errors["run"]
    )
    assert "check the path (for a URL: the bucket, prefix and spelling)" in errors["nothing"]
    assert _keys(bucket) == before  # nothing lost: evaluating reads, never clears a save


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refused(overrides, url: str, run_dir) -> str:
    """The message starting a run with checkpoint.dir = `url` fails with, before any step."""
    kiln.checkpoint.store._OBJECT_STORES.clear()  # a new process would read the environment anew
    with pytest.raises(KilnError) as raised:
        make_trainer(overrides, *SHORT, f"--checkpoint.dir={url}")
    assert not (run_dir / "metrics.jsonl").exists()  # no step ran
    return str(raised.value)


@pytest.mark.usefixtures("fresh_store")
def test_an_unusable_bucket_is_one_message_before_the_first_step(
    debug_overrides, tmp_path, bucket, s3_endpoint, monkeypatch
):
    run_dir = tmp_path / "run"
    missing = _refused(debug_overrides, "s3://kiln-no-such-bucket/run", run_dir)
    assert "cannot write to s3://kiln-no-such-bucket/run: it does not exist" in missing
    assert not store_for(location("s3://kiln-no-such-bucket")).fs.exists("kiln-no-such-bucket")

    # botocore's own retry setting, as a user may set it: one attempt, no backoff.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    closed = _refused(debug_overrides, f"s3://{bucket}/run", run_dir)
    assert "it could not be reached: check the host or endpoint" in closed

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    # Nowhere else to find credentials: no files, no instance metadata service.
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    no_keys = _refused(debug_overrides, f"s3://{bucket}/run", run_dir)
    assert "no valid credentials for it: set AWS_ACCESS_KEY_ID" in no_keys


@pytest.mark.usefixtures("fresh_store")
def test_a_protocol_without_its_package_is_named_by_the_cli(debug_overrides, capsys):
    """gcsfs is not a dependency of kiln: gs:// needs it installed, and the CLI says so."""
    try:
        import gcsfs  # noqa: F401

        pytest.skip("gcsfs is installed here")
    except ImportError:
        pass
    code = main(["train", str(DEBUG_CONFIG), *debug_overrides, *SHORT, "--checkpoint.dir=gs://b/r"])
    assert code == 2
    assert "no filesystem for gs://: install gcsfs" in capsys.readouterr().err


# Another run, in a process of its own, holding a prefix until its standard input closes.
_HOLDER = """
import sys
from kiln.checkpoint.lease import Lease
from kiln.checkpoint.store import location
lease = Lease(location(sys.argv[1]), run="another-run", run_dir="/elsewhere/run")
lease.take(wait_s=0)
print("held", flush=True)
sys.stdin.read()
lease.release()
"""


def test_a_prefix_held_by_another_live_run_is_waited_for_then_refused(
    debug_overrides, bucket, capsys
):
    root = f"s3://{bucket}/run"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, root],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        args = [*debug_overrides, *SHORT, f"--checkpoint.dir={root}", "--checkpoint.owner_wait_s=1"]
        assert main(["train", str(DEBUG_CONFIG), *args]) == 2
        err = capsys.readouterr().err
        assert f"held by run another-run (host {socket.gethostname()}, pid {holder.pid}" in err
        assert "waiting up to 1 s" in err and "checkpoint.owner_wait_s" in err
        assert _keys(bucket) == ["run/OWNER"]  # nothing written, nothing removed
        assert main(["check", str(DEBUG_CONFIG), *args]) == 0  # kiln check says so up front
        assert f"is held now by run another-run (host {socket.gethostname()}" in (
            capsys.readouterr().out
        )
    finally:
        holder.communicate("", timeout=60)
    assert _keys(bucket) == []  # released by its holder

    # A lease whose holder stopped renewing it long ago (a killed job) is taken over.
    stale = {"run": "dead", "host": "gone", "pid": 1, "run_dir": "/x", "heartbeat": 0.0}
    store_for(location(root)).write_bytes(location(root) / "OWNER", json.dumps(stale).encode())
    lease = Lease(location(root), run="next", run_dir="/y")
    lease.take(wait_s=0)
    assert lease.holder().run == "next"
    lease.release()
    assert _keys(bucket) == []
