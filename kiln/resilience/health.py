"""`resilience.preflight`: before training, check every rank. On CUDA each GPU's timed bf16
matmul and ECC counter (gpu_check.py); on several ranks a timed all-reduce over the world and each
mesh dimension. A rank that fails or never arrives stops the job naming it and its host; a slow
one is named in a warning (a loaded machine can be slow, and a slow rank still trains).

A late rank waits least inside a collective: the others wait for it. So each rank times its own
wait (a duration: clocks on different hosts are not comparable), every rank gathers all of them,
and the verdict is a function of the gathered values alone, the same on every rank.
"""

from __future__ import annotations

import datetime
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from kiln.config.sections import JobConfig, ResilienceConfig
from kiln.errors import KilnError, RelayedError, first_line
from kiln.events import EventLog
from kiln.log import info, warn
from kiln.resilience import flight_recorder
from kiln.resilience.gpu_check import check_gpu

# Each timed all-reduce moves 1 MiB of fp32: enough to exercise the links, a few milliseconds
# on gloo over loopback, and far less on NCCL.
PAYLOAD_ELEMENTS = 1 << 18
ROUNDS = 3
# A healthy GPU reaches 50-80% of its datasheet bf16 rate on a large matmul; under a quarter it
# is throttled or misconfigured.
MIN_OF_PEAK = 0.25
STAGE_KEY = "kiln/preflight/rank_{}"


def preflight(
    cfg: JobConfig, mesh: DeviceMesh | None, device: torch.device, *, events: EventLog
) -> None:
    """Install the flight recorder (a run on several ranks), then, with resilience.preflight,
    check every rank: raise KilnError naming each failing rank and host, warn about slow ones."""
    hosts = flight_recorder.install(
        Path(cfg.metrics.run_dir), distributed=mesh is not None, cuda=device.type == "cuda"
    )
    if not cfg.resilience.preflight or (mesh is None and device.type != "cuda"):
        return  # one CPU process: no GPU and no link to check
    rank = 0 if mesh is None else dist.get_rank()
    if mesh is not None:
        _post_stage("the GPU check" if device.type == "cuda" else "the start of the check")
    report = check_gpu(device) if device.type == "cuda" else {}
    if mesh is not None:
        report["waits"] = _timed_all_reduces(mesh, device, cfg.resilience, hosts)
    reports = [report] if mesh is None else _gather(report)
    failures, slow = assess(reports, hosts, cfg.resilience)
    if failures:
        message = "the start-up health check failed (resilience.preflight):\n" + "\n".join(failures)
        raise KilnError(message) if rank == 0 else RelayedError(message)
    if rank == 0:
        for line in slow:
            warn(f"health check: {line}")
        info(f"health check: {overview(reports, hosts)}")
    if slow:  # a run that starts well leaves no trace before it has started
        events.write("preflight", slow=slow, overview=overview(reports, hosts))


def assess(reports: list[dict], hosts: list[str], cfg: ResilienceConfig) -> tuple[list, list]:
    """(failures, slow ranks), each a list of lines naming rank and host, from every rank's
    report: `error`, `tflops`, `peak_tflops`, `ecc` (GPU), `waits` (label → ranks, seconds)."""
    failures = [
        f"{_who(r, hosts)}: {rep['error']}" for r, rep in enumerate(reports) if "error" in rep
    ]
    slow = []
    rates = {r: rep["tflops"] for r, rep in enumerate(reports) if "tflops" in rep}
    median = statistics.median(rates.values()) if rates else 0.0
    for r, rate in rates.items():
        peak = reports[r]["peak_tflops"]
        if rate < cfg.preflight_slow_matmul * median:
            slow.append(
                f"{_who(r, hosts)}: bf16 matmul at {rate:.0f} TFLOP/s, {rate / median:.0%} of the "
                f"ranks' median (resilience.preflight_slow_matmul = {cfg.preflight_slow_matmul:g})"
            )
        elif peak and rate < MIN_OF_PEAK * peak:
            slow.append(f"{_who(r, hosts)}: bf16 matmul at {rate:.0f} of {peak:.0f} TFLOP/s")
    for r, rep in enumerate(reports):
        if rep.get("ecc"):
            slow.append(f"{_who(r, hosts)}: {rep['ecc']} uncorrected ECC errors on its GPU")
    return failures, slow + _late_ranks(reports, hosts, cfg.preflight_slow_s)


def _late_ranks(reports: list[dict], hosts: list[str], slow_s: float) -> list[str]:
    """Ranks the others waited for in a health-check all-reduce, by how long."""
    groups: dict[tuple[str, tuple[int, ...]], dict[int, float]] = {}
    for r, rep in enumerate(reports):
        for label, (ranks, seconds) in rep.get("waits", {}).items():
            groups.setdefault((label, tuple(ranks)), {})[r] = seconds
    lines = []
    for (label, _), waits in groups.items():
        for r, own in waits.items():
            others = [seconds for other, seconds in waits.items() if other != r]
            if not others:  # a group of one rank waits for nobody
                continue
            late = statistics.median(others) - own
            if late > slow_s:
                lines.append(
                    f"{_who(r, hosts)}: the others waited {late:.1f} s for it in the all-reduce "
                    f"over {label} (resilience.preflight_slow_s = {slow_s:g})"
                )
    return lines


def overview(reports: list[dict], hosts: list[str]) -> str:
    """One line: ranks, hosts, the slowest rank's total wait over each group, the matmul rates."""
    parts = [f"{len(reports)} rank(s) on {len(set(hosts))} host(s)"]
    labels = dict.fromkeys(label for rep in reports for label in rep.get("waits", {}))
    if labels:
        waits = [max(rep["waits"][label][1] for rep in reports) for label in labels]
        timed = ", ".join(
            f"{label} {w * 1e3:.1f} ms" for label, w in zip(labels, waits, strict=True)
        )
        parts.append(f"{ROUNDS} all-reduces of 1 MiB over {timed}")
    rates = [rep["tflops"] for rep in reports if "tflops" in rep]
    if rates:
        parts.append(f"bf16 matmul {min(rates):.0f}-{max(rates):.0f} TFLOP/s")
    if any(rep.get("ecc") is None and "tflops" in rep for rep in reports):
        parts.append("ECC not read on every GPU (no nvidia-smi, or ECC off)")
    return "; ".join(parts)


def _timed_all_reduces(
    mesh: DeviceMesh, device: torch.device, cfg: ResilienceConfig, hosts: list[str]
) -> dict[str, tuple[list[int], float]]:
    """This rank's wait in ROUNDS all-reduces over the world and each mesh dimension of more than
    one rank (and fewer than all): label → (the group's ranks, seconds)."""
    world = dist.get_world_size()
    groups = [("the world", dist.group.WORLD)] + [
        (dim, mesh.get_group(dim))
        for i, dim in enumerate(mesh.mesh_dim_names)
        if 1 < mesh.size(i) < world
    ]
    payload = torch.ones(PAYLOAD_ELEMENTS, device=device)
    timeout = datetime.timedelta(seconds=cfg.preflight_timeout_s)
    waits = {}
    for label, group in groups:
        seconds = 0.0
        for _ in range(ROUNDS):
            try:
                seconds += _timed_all_reduce(payload, group, timeout, stage=label)
            except RuntimeError as error:
                raise KilnError(_stuck(label, error, hosts, cfg)) from None
        waits[label] = (dist.get_process_group_ranks(group), seconds)
    return waits


def _timed_all_reduce(
    payload: torch.Tensor, group: dist.ProcessGroup, timeout: datetime.timedelta, *, stage: str
) -> float:
    """Seconds this rank spent in one all-reduce over `group` (labelled `stage`), failing after
    `timeout`."""
    _post_stage(f"the all-reduce over {stage}")
    began = time.perf_counter()
    work = dist.all_reduce(payload, group=group, async_op=True)
    try:
        work.wait(timeout)
    except RuntimeError as error:
        # A backend written in Python (a Future-wrapping work) has no bounded wait: the
        # backend's own collective timeout bounds this one.
        if "with finite timeout not implemented" not in str(error):
            raise
        work.wait()
    if payload.is_cuda:
        torch.cuda.synchronize(payload.device)  # NCCL's wait only orders the stream
    return time.perf_counter() - began


def _stuck(label: str, error: RuntimeError, hosts: list[str], cfg: ResilienceConfig) -> str:
    """Which ranks never reached the all-reduce over `label`, from the stage each one posted."""
    try:
        stages = [_stage_of(r) for r in range(dist.get_world_size())]
    except RuntimeError:  # the store lived in a rank that has already ended
        stages = []
    elsewhere = [
        f"{_who(r, hosts)} never entered it (last seen in {stage})"
        for r, stage in enumerate(stages)
        if stage != f"the all-reduce over {label}"
    ]
    cause = (
        "; ".join(elsewhere)
        if elsewhere
        else "no rank is known to be elsewhere: one gave up on it first (its log says why), or "
        "a link between them failed"
    )
    return (
        f"rank {dist.get_rank()}: the health check's all-reduce over {label} failed or did not "
        f"complete within {cfg.preflight_timeout_s:g} s (resilience.preflight_timeout_s): "
        f"{cause} ({first_line(error)})"
    )


def _stage_of(rank: int) -> str:
    store, key = dist.distributed_c10d._get_default_store(), STAGE_KEY.format(rank)
    return store.get(key).decode() if store.check([key]) else "start-up, before the check"


def _post_stage(stage: str) -> None:
    # Posted to the job's store, which outlives a hung collective: a rank that times out reads
    # where each other rank is.
    dist.distributed_c10d._get_default_store().set(STAGE_KEY.format(dist.get_rank()), stage)


def _gather(report: dict) -> list[dict]:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    return gathered


def _who(rank: int, hosts: list[str]) -> str:
    return f"rank {rank} ({hosts[rank]})"
