"""Checkpoint throughput on CPU, one process: kiln's CheckpointSaver against the disk it writes to.

In one run, in one target folder:

1. the disk: `dd if=/dev/zero bs=1M conv=fdatasync` of as many bytes as the large checkpoint,
   then reading that file back with `dd` while it is still in the page cache and again after its
   pages were dropped (posix_fadvise DONTNEED on the file: no root, no global cache drop);
2. a large state (default ~1.0B parameters, fp32, AdamW with its state allocated): synchronous
   `CheckpointSaver.save` (DCP fsyncs each data file and `.metadata`), then `load_checkpoint`
   into a fresh model and optimizer, from the page cache and with the files' pages dropped;
3. a smaller state (default ~350M parameters, since async staging holds a second copy of the
   state in memory): how long `save()` blocks the caller in sync and async mode, and how long
   until `wait()` returns; the load of a real resume (fresh optimizer without state, so DCP first
   runs a zero-gradient step to allocate it); and the step time of a small training loop while a
   background save is being written.

Each timing is repeated `--repeats` times; tables give the median (min-max). GB = 1e9 bytes,
GiB = 2^30 bytes. Checkpoint folders are deleted at the end.

    OMP_NUM_THREADS=2 python benchmarks/checkpoint.py [--dir /tmp/kiln_ckpt_bench] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import statistics
import subprocess
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.checkpoint import layout
from kiln.checkpoint.checkpointer import load_checkpoint
from kiln.checkpoint.saver import CheckpointSaver
from kiln.config import load_config
from kiln.model import build_model, count_params, materialize
from kiln.train.optimizer import build_optimizer

LARGE = "dim=2048,n_layers=16,n_heads=16,n_kv_heads=16,ffn_hidden_dim=6144,vocab_size=32000"
SMALL = "dim=1024,n_layers=24,n_heads=16,n_kv_heads=8,ffn_hidden_dim=2816,vocab_size=32000"
MiB = 2**20


# ---------------------------------------------------------------- measurement helpers


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} logical CPUs"


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def memory_note(label: str) -> None:
    print(f"  [{label}: RSS {gib(rss())}, peak RSS so far {gib(peak_rss())}]", flush=True)


def files(path: Path) -> list[Path]:
    return [path] if path.is_file() else [p for p in sorted(path.rglob("*")) if p.is_file()]


def size_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in files(path))


def drop_cached_pages(path: Path) -> None:
    """Evict the files' pages from the page cache (clean pages only, hence the sync first)."""
    os.sync()
    for p in files(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(path: Path) -> float | None:
    """Share of the files' bytes in the page cache, from util-linux `fincore` if present."""
    if shutil.which("fincore") is None:
        return None
    paths = [str(p) for p in files(path)]
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", *paths],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    resident, total = sum(map(int, out[0::2])), sum(map(int, out[1::2]))
    return resident / total if total else None


def pct(fraction: float | None) -> str:
    return "?" if fraction is None else f"{100 * fraction:.0f}%"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cpu_seconds() -> float:
    """User + system CPU time of this process, all its threads (not the kernel's flusher threads)."""
    t = os.times()
    return t.user + t.system


class Timing:
    """Wall and process CPU seconds of each repeat of one operation."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def run(self, fn):
        cpu, start = cpu_seconds(), time.perf_counter()
        out = fn()
        self.wall.append(time.perf_counter() - start)
        self.cpu.append(cpu_seconds() - cpu)
        return out

    def last(self) -> str:
        return f"{self.wall[-1]:.2f} s (CPU {self.cpu[-1]:.2f} s)"


def disk_write(path: Path, nbytes: int) -> float:
    """`dd ... conv=fdatasync` of `nbytes` (rounded to MiB), or the same as a write+fsync loop."""
    count = -(-nbytes // MiB)
    if shutil.which("dd"):
        cmd = ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={count}", "conv=fdatasync"]
        return timed(lambda: subprocess.run(cmd, check=True, capture_output=True))

    def loop():
        block = bytes(MiB)
        with open(path, "wb") as f:
            for _ in range(count):
                f.write(block)
            f.flush()
            os.fdatasync(f.fileno())

    return timed(loop)


def disk_write_random(path: Path, nbytes: int) -> float:
    """A Python write+fsync loop of `nbytes` that are not zeros (one 64 MiB random block, written
    again and again), in case the storage treats blocks of zeros specially."""
    block = os.urandom(64 * MiB)

    def loop():
        with open(path, "wb") as f:
            left = nbytes
            while left > 0:
                left -= f.write(memoryview(block)[: min(left, len(block))])
            f.flush()
            os.fsync(f.fileno())

    return timed(loop)


def disk_read(path: Path) -> float:
    if shutil.which("dd"):
        cmd = ["dd", f"if={path}", "of=/dev/null", "bs=1M"]
        return timed(lambda: subprocess.run(cmd, check=True, capture_output=True))

    def loop():
        with open(path, "rb", buffering=0) as f:
            while f.read(MiB):
                pass

    return timed(loop)


def row(name: str, t: Timing | list[float], nbytes: int | None = None) -> str:
    """A table row: median (min-max) seconds, GB/s of the median, median process CPU seconds."""
    wall, cpu = (t.wall, t.cpu) if isinstance(t, Timing) else (t, None)
    med = statistics.median(wall)
    rate = f"{nbytes / 1e9 / med:.2f}" if nbytes else ""
    cpu_text = f"{statistics.median(cpu):.2f}" if cpu else "-"
    return f"| {name} | {med:.2f} ({min(wall):.2f}-{max(wall):.2f}) | {rate} | {cpu_text} |"


TABLE = "| operation | seconds, median (min-max) | GB/s | process CPU s |\n|---|---|---|---|"


# ---------------------------------------------------------------- the state


def job_config(spec: str):
    return load_config(None, [f"--model.{kv}" for kv in spec.split(",") if kv])


def allocate_optimizer_state(model, optimizer, *, grad_scale: float) -> None:
    """Give every parameter its AdamW state (step, exp_avg, exp_avg_sq) as one step would, one
    parameter at a time: a whole-model foreach step would add a full gradient and a full-size
    temporary (8 GB more at 1B parameters in fp32)."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    if grad_scale == 0.0:  # what DCP's own initialization does: zero grads, lr 0
        for group in optimizer.param_groups:
            group["lr"] = 0.0
    for p in model.parameters():
        p.grad = p.detach() * grad_scale
        optimizer.step()
        p.grad = None
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def build_state(cfg, *, optimizer_state: str):
    """fp32 model on CPU and AdamW; optimizer_state: 'trained' | 'allocated' | 'none'."""
    model = materialize(build_model(cfg.model), device="cpu", seed=cfg.train.seed)
    (optimizer,) = build_optimizer(model, cfg.optimizer)
    if optimizer_state != "none":
        allocate_optimizer_state(
            model, optimizer, grad_scale=1e-2 if optimizer_state == "trained" else 0.0
        )
    return model, optimizer


def state_bytes(model, optimizer) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return total


def fingerprint(model, optimizer) -> list[torch.Tensor]:
    """A few slices of weights and optimizer state, to check that a load restored them."""
    params = list(model.parameters())
    picks = [params[0], params[len(params) // 2], params[-1]]
    out = [p.detach().flatten()[:4096].clone() for p in picks]
    for p in picks:
        out += [optimizer.state[p][k].flatten()[:4096].clone() for k in ("exp_avg", "exp_avg_sq")]
    return out


def save(saver: CheckpointSaver, step: int, model, optimizer, cfg) -> Path:
    saver.save(step, model=model, optimizer=optimizer, config=cfg, train_state={"tokens_seen": 0})
    return layout.step_dir(saver.root, step)


# ---------------------------------------------------------------- the phases


def large_state(args, root: Path) -> dict:
    cfg = job_config(args.large)
    n = count_params(cfg.model).total
    print(f"\n## Large state: {args.large}\n  {n:,} parameters (count_params)", flush=True)
    start = time.perf_counter()
    model, optimizer = build_state(cfg, optimizer_state="trained")
    nbytes = state_bytes(model, optimizer)
    print(
        f"  built in {time.perf_counter() - start:.1f} s: model + AdamW state {nbytes / 1e9:.2f} GB "
        f"({gib(nbytes)}) in fp32",
        flush=True,
    )
    memory_note("large state built")

    dd_file = root / "dd.bin"
    r = {"params": n, "state_bytes": nbytes, "save": Timing(), "sync_after": []}
    r |= {k: [] for k in ("py_write", "dd_write", "dd_read_cached", "dd_read_cold", "dd_cached")}
    saved = None
    for i in range(args.repeats):
        # the disk alone: the same number of bytes, in the same folder
        os.sync()
        r["py_write"].append(disk_write_random(dd_file, nbytes))
        dd_file.unlink()
        os.sync()
        r["dd_write"].append(disk_write(dd_file, nbytes))
        r["dd_cached"].append(cached_fraction(dd_file))
        r["dd_read_cached"].append(disk_read(dd_file))
        drop_cached_pages(dd_file)
        r["dd_read_cold"].append(disk_read(dd_file))
        r["dd_bytes"] = dd_file.stat().st_size
        dd_file.unlink()
        # kiln's synchronous save, into a new root each time (the previous one is deleted first)
        if saved is not None:
            shutil.rmtree(saved.parent)
        os.sync()
        saver = CheckpointSaver(root / f"sync_{i}")
        saved = r["save"].run(partial(save, saver, 100 + i, model, optimizer, cfg))
        r["sync_after"].append(timed(os.sync))
        r["ckpt_bytes"] = size_on_disk(saved)
        print(
            f"  repeat {i}: write+fsync of random bytes {r['py_write'][-1]:.2f} s, "
            f"dd write {r['dd_write'][-1]:.2f} s, dd read ({pct(r['dd_cached'][-1])} cached) "
            f"{r['dd_read_cached'][-1]:.2f} s, dd read after dropping its pages "
            f"{r['dd_read_cold'][-1]:.2f} s; save {r['save'].last()} "
            f"(+ os.sync {r['sync_after'][-1]:.2f} s)",
            flush=True,
        )
    memory_note("after sync saves")

    expected = fingerprint(model, optimizer)
    del model, optimizer
    gc.collect()
    # A fresh model and optimizer; the optimizer state is allocated beforehand (see
    # allocate_optimizer_state) so that load_checkpoint does not run DCP's whole-model init step.
    model, optimizer = build_state(cfg, optimizer_state="allocated")
    memory_note("fresh model + optimizer built")
    r |= {"load_warm": Timing(), "load_cold": Timing(), "warm_cached": []}
    load = partial(load_checkpoint, saved, model=model, optimizer=optimizer)
    for i in range(args.repeats):
        r["warm_cached"].append(cached_fraction(saved))
        r["load_warm"].run(load)
        drop_cached_pages(saved)
        r["load_cold"].run(load)
        print(
            f"  repeat {i}: load ({pct(r['warm_cached'][-1])} of the files cached) "
            f"{r['load_warm'].last()}, load after dropping its pages {r['load_cold'].last()}",
            flush=True,
        )
    got = fingerprint(model, optimizer)
    r["load_ok"] = all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    print(f"  loaded state equals the saved state: {r['load_ok']}")
    memory_note("after loads")
    del model, optimizer, load
    gc.collect()
    shutil.rmtree(saved.parent)
    return r


def train_step_fn(preset: str):
    """A small training step (forward, cross entropy, backward, AdamW) for the contention test."""
    cfg = load_config(None, [f"--model.preset={preset}"])
    model = materialize(build_model(cfg.model), device="cpu", seed=0)
    (optimizer,) = build_optimizer(model, cfg.optimizer)
    tokens = torch.randint(
        0, cfg.model.vocab_size, (2, 257), generator=torch.Generator().manual_seed(0)
    )
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step():
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def small_state(args, root: Path) -> dict:
    cfg = job_config(args.small)
    n = count_params(cfg.model).total
    print(f"\n## Small state: {args.small}\n  {n:,} parameters (count_params)", flush=True)
    model, optimizer = build_state(cfg, optimizer_state="trained")
    nbytes = state_bytes(model, optimizer)
    print(f"  model + AdamW state {nbytes / 1e9:.2f} GB ({gib(nbytes)})", flush=True)
    memory_note("small state built")

    r = {"params": n, "state_bytes": nbytes, "sync": Timing(), "async_block": Timing()}
    r |= {"async_total": [], "train_block": [], "train_total": [], "idle": [], "during": []}
    sync_saver = CheckpointSaver(root / "small_sync", keep_last_n=1)
    async_saver = CheckpointSaver(root / "small_async", keep_last_n=1, async_mode="async")
    step = train_step_fn(args.train_preset) if args.train_preset else None
    if step is not None:
        for _ in range(3):
            step()
    for i in range(args.repeats):
        os.sync()
        r["sync"].run(partial(save, sync_saver, 10 * i + 1, model, optimizer, cfg))
        os.sync()
        start = time.perf_counter()
        r["async_block"].run(partial(save, async_saver, 10 * i + 2, model, optimizer, cfg))
        async_saver.wait(after_step=0)
        r["async_total"].append(time.perf_counter() - start)
        line = (
            f"  repeat {i}: sync save() {r['sync'].last()}; async save() blocks "
            f"{r['async_block'].last()}, wait() returns after {r['async_total'][-1]:.2f} s"
        )
        if step is not None:  # steps without a save, then steps while a save is written
            idle = [timed(step) for _ in range(args.train_steps)]
            os.sync()
            start = time.perf_counter()
            save(async_saver, 10 * i + 3, model, optimizer, cfg)
            r["train_block"].append(time.perf_counter() - start)
            during = []
            while not async_saver.in_flight.future.done():
                during.append(timed(step))
            async_saver.wait(after_step=0)
            r["train_total"].append(time.perf_counter() - start)
            r["idle"] += idle
            r["during"] += during
            line += (
                f"; train step {1e3 * statistics.median(idle):.0f} ms without a save, "
                f"{1e3 * statistics.median(during):.0f} ms during one ({len(during)} steps, "
                f"that save committed after {r['train_total'][-1]:.2f} s)"
            )
        print(line, flush=True)
    r["ckpt_bytes"] = size_on_disk(layout.latest_complete(root / "small_sync"))
    memory_note("after async saves (staging buffer held)")
    async_saver.close(after_step=0)
    sync_saver.close(after_step=0)
    memory_note("staging buffer released")

    # A resume: fresh optimizer without state. load_checkpoint then has DCP allocate it with a
    # zero-grad foreach step over the whole model; against that, allocating it one parameter at
    # a time first (allocate_optimizer_state), then loading.
    saved = layout.latest_complete(root / "small_async")
    expected = fingerprint(model, optimizer)
    del optimizer
    gc.collect()
    r |= {"resume": Timing(), "alloc": Timing(), "load_alloc": Timing(), "resume_cached": []}
    for i in range(args.repeats):
        (fresh,) = build_optimizer(model, cfg.optimizer)
        r["resume_cached"].append(cached_fraction(saved))
        r["resume"].run(partial(load_checkpoint, saved, model=model, optimizer=fresh))
        got = fingerprint(model, fresh)
        del fresh
        gc.collect()
        (fresh,) = build_optimizer(model, cfg.optimizer)
        r["alloc"].run(partial(allocate_optimizer_state, model, fresh, grad_scale=0.0))
        r["load_alloc"].run(partial(load_checkpoint, saved, model=model, optimizer=fresh))
        del fresh
        gc.collect()
        print(
            f"  repeat {i}: load, fresh optimizer ({pct(r['resume_cached'][-1])} cached) "
            f"{r['resume'].last()}; per-parameter allocation {r['alloc'].last()} + load "
            f"{r['load_alloc'].last()}",
            flush=True,
        )
    r["load_ok"] = all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    print(f"  loaded state equals the saved state: {r['load_ok']}", flush=True)
    memory_note("after resume loads")
    return r


def report(args, large: dict | None, small: dict | None) -> None:
    print(f"\n## Summary: median (min-max) of {args.repeats} repeats\n")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_name()}")
    print(f"target folder {args.dir}; peak RSS of this process {gib(peak_rss())}\n")
    if large:
        b, ck, dd = large["state_bytes"], large["ckpt_bytes"], large["dd_bytes"]
        print(
            f"Large: {large['params']:,} parameters; state {b / 1e9:.2f} GB; "
            f"checkpoint on disk {ck / 1e9:.2f} GB; dd file {dd / 1e9:.2f} GB\n"
        )
        print(TABLE)
        print(row("dd write, conv=fdatasync", large["dd_write"], dd))
        print(row("Python write + fsync, random bytes", large["py_write"], b))
        cached = "/".join(pct(x) for x in large["dd_cached"])
        print(row(f"dd read ({cached} in page cache)", large["dd_read_cached"], dd))
        print(row("dd read, pages dropped", large["dd_read_cold"], dd))
        print(row("CheckpointSaver.save, sync (DCP fsyncs)", large["save"], ck))
        print(row("os.sync() right after that save", large["sync_after"]))
        cached = "/".join(pct(x) for x in large["warm_cached"])
        print(row(f"load_checkpoint ({cached} in page cache)", large["load_warm"], ck))
        print(row("load_checkpoint, pages dropped", large["load_cold"], ck))
        save_rate = ck / statistics.median(large["save"].wall)
        dd_rate = dd / statistics.median(large["dd_write"])
        py_rate = b / statistics.median(large["py_write"])
        print(
            f"\nsave throughput = {save_rate / dd_rate:.2f}x dd's, {save_rate / py_rate:.2f}x the "
            f"random write+fsync loop's; loaded state equals saved: {large['load_ok']}\n"
        )
    if small:
        b, ck = small["state_bytes"], small["ckpt_bytes"]
        print(
            f"Small: {small['params']:,} parameters; state {b / 1e9:.2f} GB; "
            f"checkpoint on disk {ck / 1e9:.2f} GB\n"
        )
        print(TABLE)
        print(row("sync save(): caller blocked", small["sync"], ck))
        blocks = ", ".join(f"{x:.2f}" for x in small["async_block"].wall)
        print(row(f"async save(): caller blocked (repeats: {blocks} s)", small["async_block"], b))
        print(row("async: save() until wait() returns", small["async_total"], ck))
        if small["train_total"]:
            print(row("async during training: caller blocked", small["train_block"], b))
            print(row("async during training: until committed", small["train_total"], ck))
        print(row("load_checkpoint, fresh optimizer (DCP init step)", small["resume"], ck))
        print(row("allocate AdamW state per parameter", small["alloc"]))
        print(row("load_checkpoint after that allocation", small["load_alloc"], ck))
        print(f"\nloaded state equals saved: {small['load_ok']}")
        if small["idle"]:
            idle, during = small["idle"], small["during"]
            print(
                f"\nTraining step ({args.train_preset} preset, 2 x 256 tokens, fp32 AdamW), over "
                f"{args.repeats} rounds: median {1e3 * statistics.median(idle):.0f} ms "
                f"({len(idle)} steps) without a save, {1e3 * statistics.median(during):.0f} ms "
                f"({len(during)} steps, mean {1e3 * statistics.mean(during):.0f} ms) while "
                f"a background save is written: "
                f"{statistics.median(during) / statistics.median(idle):.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=Path("/tmp/kiln_ckpt_bench"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--large", default=LARGE, help="model keys of the large state ('' skips)")
    parser.add_argument("--small", default=SMALL, help="model keys of the async state ('' skips)")
    parser.add_argument(
        "--train-preset",
        default="demo",
        help="model preset of the training loop timed during background saves ('' skips)",
    )
    parser.add_argument("--train-steps", type=int, default=8, help="steps without a save per round")
    args = parser.parse_args()

    root = args.dir / f"run-{os.getpid()}"
    root.mkdir(parents=True)
    try:
        large = large_state(args, root) if args.large else None
        small = small_state(args, root) if args.small else None
        report(args, large, small)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
