"""Checkpoint save and load time in an S3 bucket (moto's server on the loopback interface)
against the local filesystem, in one run, for the debug model and the llama3_125m preset.

Each state is an fp32 model on CPU with its AdamW state allocated (one step's worth). Per model
and target, `--repeats` times: `save_checkpoint` (kiln's synchronous save: the staged folder or
step prefix, DCP's shards, the commit), then `load_checkpoint` into the same model and optimizer
(resolving the newest step, reading the shards and the train state). The loaded state is checked
against the saved one. The S3 server is moto's, started as a separate process (`python -m
moto.server`) so that it does not share this process's interpreter lock; credentials and the
endpoint come from the standard AWS variables, as a user would set them.

    OMP_NUM_THREADS=2 python benchmarks/checkpoint_object_store.py [--repeats 3] [--dir /tmp/...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln.checkpoint.checkpointer import load_checkpoint, save_checkpoint
from kiln.checkpoint.store import location, store_for
from kiln.config import load_config
from kiln.model import build_model, materialize
from kiln.train.optimizer import build_optimizer

MODELS = ("debug", "llama3_125m")
BUCKET = "kiln-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(log: Path) -> tuple[subprocess.Popen, str]:
    """moto's S3 server in its own process, logging to `log`; its endpoint once it answers."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit("moto's server did not start")


def build_state(preset: str):
    """The job config, an fp32 model of `preset` and AdamW with its state allocated."""
    cfg = load_config(None, [f"--model.preset={preset}"])
    model = materialize(build_model(cfg.model), device="cpu", seed=0)
    (optimizer,) = build_optimizer(model, cfg.optimizer)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return cfg, model, optimizer


def state_bytes(model, optimizer) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return total


def snapshot(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def time_target(root: str, cfg, model, optimizer, repeats: int) -> dict[str, list[float]]:
    """Save and load times (s) of `repeats` checkpoints under `root`; each load checked."""
    saved = snapshot(model)
    times: dict[str, list[float]] = {"save": [], "load": []}
    for step in range(1, repeats + 1):
        began = time.perf_counter()
        save_checkpoint(
            root, step, model=model, optimizer=optimizer, config=cfg, train_state={}, keep_last_n=1
        )
        times["save"].append(time.perf_counter() - began)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        began = time.perf_counter()
        load_checkpoint(root, model=model, optimizer=optimizer)
        times["load"].append(time.perf_counter() - began)
        assert all(torch.equal(a, b) for a, b in zip(saved, snapshot(model), strict=True))
    return times


def on_store_bytes(root: str) -> int:
    at = location(root)
    return sum(store_for(at).files(at).values())


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def run(args) -> None:
    import boto3

    server, endpoint = start_moto(Path(args.server_log))
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        # moto sometimes fails the completion of a large multipart upload (HTTP 500, "seek of
        # closed file" in its models.py); botocore's retries recover, given a few more.
        AWS_MAX_ATTEMPTS="10",
    )
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    local_root = Path(args.dir or tempfile.mkdtemp(prefix="kiln_ckpt_s3_bench_"))
    print("| model | state | target | save s, median (min-max) | load s, median (min-max) |")
    print("|---|---|---|---|---|")
    ratios = []
    try:
        for preset in args.models.split(","):
            cfg, model, optimizer = build_state(preset)
            size = f"{state_bytes(model, optimizer) / 1e6:.1f} MB"
            targets = {
                "local disk": str(local_root / preset),
                "S3 (moto)": f"s3://{BUCKET}/{preset}",
            }
            results = {}
            for name, root in targets.items():
                results[name] = time_target(root, cfg, model, optimizer, args.repeats)
                written = on_store_bytes(root) / 1e6
                print(
                    f"| {preset} | {size} | {name} ({written:.1f} MB written) | "
                    f"{median(results[name]['save'])} | {median(results[name]['load'])} |",
                    flush=True,
                )
            ratios.append((preset, results))
    finally:
        server.kill()
        shutil.rmtree(local_root, ignore_errors=True)
    errors = Path(args.server_log).read_text(errors="replace").count('" 500 ')
    print(f"\nmoto answered {errors} requests with HTTP 500 (retried by botocore)")
    print("\n| model | save: S3 / disk | load: S3 / disk |\n|---|---|---|")
    for preset, results in ratios:
        s3, disk = results["S3 (moto)"], results["local disk"]
        save = statistics.median(s3["save"]) / statistics.median(disk["save"])
        load = statistics.median(s3["load"]) / statistics.median(disk["load"])
        print(f"| {preset} | {save:.1f}x | {load:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated presets")
    parser.add_argument("--server-log", default="/tmp/kiln_moto_server.log")
    parser.add_argument("--dir", default="", help="local target folder (default: a temp folder)")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
