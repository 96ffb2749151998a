"""`kiln plan --fault-tolerance`: whether replica groups pay on the chosen layout, by the model of
docs/fault_tolerance.md ("When replica groups pay"), whose symbols the code uses.

A failure of one GPU costs, with checkpoint restarts, every GPU the restart R and on average half
a checkpoint interval I; with replica groups (the layout's dp_replicate groups of n GPUs), the
failed group's restart R_g and the survivors' stall S. Replica groups cost o on every step:

  every step   the cross-group sum of the gradients. In groups of more than one GPU (FSDP wraps
               them) without expert parallel it runs in the backward as HSDP's all-reduce does
               (FSDP2's all-reduce hook, kiln/parallel/replica_groups.py), so the overlap rule
               (throughput.py) applies to it, but for the root unit's share (embeddings, final
               norm, head): that unit is reduced last, after the backward, with nothing left to
               hide it. Elsewhere (ep > 1, groups of one GPU: no FSDP) the whole sum runs after
               the backward. Plus the fixed per-step time (quorum round trip, commit vote, the
               small sums).
  DiLoCo at H  no sum in the step; every H steps one all-reduce of a step's gradient size (the
               pseudo-gradient, fp32 shards) and the fixed time, exposed: both / H per step. A
               failed group also loses its inner steps since the last sync, H/2 on average.

Each o is measured against the planner's step t for the layout as plain HSDP, so the part of
HSDP's all-reduce the overlap rule leaves exposed is in t and in neither mode's o.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from kiln.errors import ConfigError
from kiln.plan.hardware import Cluster
from kiln.plan.memory import root_unit_params
from kiln.plan.report import table
from kiln.plan.search import Candidate
from kiln.plan.throughput import (
    StepTime,
    exposed_seconds,
    gradient_shard_params,
    replica_sum_seconds,
)

HOUR = 3600.0
DAY_HOURS = 24
# 419 unexpected interruptions in 54 days on 16,384 H100s: The Llama 3 Herd of Models (2024),
# section 3.3.4; 419 / (54 × 24 × 16,384) = 1.97e-5.
LLAMA3_FAILURES_PER_GPU_HOUR = 2.0e-5
# Assumptions, each a `kiln plan` option: a requeue and restart from a checkpoint; the survivors'
# stall (the failed step, the lighthouse's heartbeat timeout, the new quorum, the rejoin); the
# fixed per-step time of replica groups, a few round trips on a datacenter network.
RESTART_S = 600.0
STALL_S = 10.0
QUORUM_MS = 5.0
# Streaming DiLoCo (2025) runs H = 100; DiLoCo (2023) 500, with more loss per token to pay.
SYNC_EVERY = 100
OVERLAPPED = ("fsdp_all_gather", "fsdp_reduce_scatter", "hsdp_all_reduce")
MODES = ("every_step", "diloco")


@dataclass(frozen=True)
class FailureInputs:
    """The model's inputs, each a `kiln plan` option (docs/fault_tolerance.md)."""

    failures_per_gpu_hour: float  # λ
    restart_s: float  # R
    checkpoint_interval: int  # steps between checkpoints
    group_restart_s: float  # R_g
    stall_s: float  # S
    quorum_ms: float  # fixed per-step time of replica groups
    sync_every: int  # DiLoCo's H

    def check(self) -> None:
        """ConfigError naming the first option out of range and what it takes."""
        takes = {
            "failures_per_gpu_hour": ("--failure-rate", "failures per GPU-hour > 0", False),
            "restart_s": ("--restart-s", "seconds > 0", False),
            "checkpoint_interval": ("--checkpoint-interval", "steps >= 1", False),
            "group_restart_s": ("--group-restart-s", "seconds > 0", False),
            "stall_s": ("--stall-s", "seconds >= 0", True),
            "quorum_ms": ("--quorum-ms", "milliseconds >= 0", True),
            "sync_every": ("--sync-every", "steps >= 1", False),
        }
        for f in fields(self):
            value = getattr(self, f.name)
            option, what, zero = takes[f.name]
            if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
                raise ConfigError(f"{option} {value:g} is out of range: it takes {what}")


@dataclass(frozen=True)
class ModeCost:
    """One way of running replica groups on the layout: its cost per step and per day."""

    seconds: float  # o: what the mode adds to each step
    fraction: float  # o / (t + o)
    lost_per_day: float  # GPU-hours
    break_even_gpus: int | None  # None: never pays


@dataclass(frozen=True)
class FaultTolerance:
    """Replica groups against checkpoint restarts on one layout."""

    candidate: Candidate
    inputs: FailureInputs
    restarts_lost_per_day: float  # GPU-hours, checkpoint restarts
    sum_in_backward: bool
    sum_seconds: float  # the cross-group sum of one step's gradients
    after_backward: float  # the part of it no compute hides
    modes: dict[str, ModeCost] | None  # None: the layout has no replica groups

    @property
    def groups(self) -> int:
        """Replica groups: the layout's dp_replicate."""
        return self.candidate.degrees["dp_replicate"]

    @property
    def group_gpus(self) -> int:
        """GPUs in one group, n."""
        return self.candidate.step.gpus // self.groups


def sums_in_backward(degrees: dict[str, int]) -> bool:
    """Whether FSDP2's all-reduce hook carries the cross-group sum (replica_groups.py in
    kiln/parallel): no expert parallel, and a group of more than one GPU, where FSDP wraps every
    parameter (over a mesh of one rank when dp_shard, ep and cp are 1); a one-GPU group has no
    FSDP."""
    return degrees["ep"] == 1 and math.prod(degrees.values()) > degrees["dp_replicate"]


def root_share(candidate: Candidate) -> float:
    """The root unit's part of a rank's gradient shard: the last unit the backward reduces."""
    d = candidate.degrees
    shard = d["dp_shard"] * d["ep"] * d["cp"]
    root = root_unit_params(candidate.cfg.model, d) / shard
    return root / gradient_shard_params(candidate.cfg.model, d)


def _exposed(step: StepTime, overlapped_sum: float, exposed_sum: float) -> float:
    """The step's exposed communication with the cross-group sum split into a part beside the
    compute and a part after it; the other collectives as the plan has them."""
    others = sum(v for k, v in step.comm.items() if k in OVERLAPPED and k != "hsdp_all_reduce")
    serial = sum(v for k, v in step.comm.items() if k not in OVERLAPPED)
    return exposed_seconds(step.compute, others + overlapped_sum, serial + exposed_sum)


def _break_even(fraction: float, group_loss_s: float, inputs: FailureInputs, t: float, n: int):
    """The GPU count, groups of n added, above which replica groups lose less: the root of
    N·f = N·λ·[N·(R + I/2) − n·R_g' − (N − n)·S] / 3600, at least two groups."""
    lam = inputs.failures_per_gpu_hour
    per_gpu = inputs.restart_s + inputs.checkpoint_interval * t / 2 - inputs.stall_s
    if per_gpu <= 0:  # a restart costs a GPU no more than a survivor's stall
        return None
    count = (HOUR * fraction / lam + n * (group_loss_s - inputs.stall_s)) / per_gpu
    return max(math.ceil(count), 2 * n)


def _per_day(gpus: int, n: int, fraction: float, group_loss_s: float, inputs: FailureInputs):
    failures = gpus * inputs.failures_per_gpu_hour
    per_failure = (n * group_loss_s + (gpus - n) * inputs.stall_s) / HOUR
    return DAY_HOURS * (failures * per_failure + gpus * fraction)


def fault_tolerance(
    candidate: Candidate, cluster: Cluster, inputs: FailureInputs
) -> FaultTolerance:
    """Replica groups on `candidate`'s layout against checkpoint restarts, by the model above."""
    inputs.check()
    step, d, cfg = candidate.step, candidate.degrees, candidate.cfg
    t, gpus = step.seconds, step.gpus
    interval = inputs.checkpoint_interval * t
    restarts = DAY_HOURS * gpus * inputs.failures_per_gpu_hour * gpus
    restarts *= (inputs.restart_s + interval / 2) / HOUR
    hooked = sums_in_backward(d)
    if d["dp_replicate"] == 1:
        return FaultTolerance(candidate, inputs, restarts, hooked, 0.0, 0.0, None)
    n, quorum = gpus // d["dp_replicate"], inputs.quorum_ms / 1000
    whole = step.comm["hsdp_all_reduce"]
    tail = whole * root_share(candidate) if hooked else whole
    every = _exposed(step, whole - tail, tail) - step.exposed + quorum
    one_sum = replica_sum_seconds(cfg, d, cluster)
    sync_every = inputs.sync_every
    diloco = _exposed(step, 0.0, 0.0) - step.exposed + (one_sum + quorum) / sync_every
    modes = {}
    for name, o, group_loss in (
        ("every_step", every, inputs.group_restart_s),
        ("diloco", diloco, inputs.group_restart_s + sync_every * t / 2),
    ):
        fraction = o / (t + o)
        modes[name] = ModeCost(
            seconds=o,
            fraction=fraction,
            lost_per_day=_per_day(gpus, n, fraction, group_loss, inputs),
            break_even_gpus=_break_even(fraction, group_loss, inputs, t, n),
        )
    return FaultTolerance(candidate, inputs, restarts, hooked, whole, tail, modes)


def as_dict(ft: FaultTolerance) -> dict:
    """`kiln plan --json`'s `fault_tolerance`: per-step fractions under `every_step` and
    `diloco`, GPU-hours lost a day and the break-even GPU count per mode, the inputs."""
    i, t = ft.inputs, ft.candidate.step.seconds
    out = {
        "layout": ft.candidate.key,
        "replica_groups": ft.groups,
        "gpus_per_group": ft.group_gpus,
        "step_seconds": round(t, 4),
        "inputs": {
            "failures_per_gpu_hour": i.failures_per_gpu_hour,
            "restart_s": i.restart_s,
            "checkpoint_interval_steps": i.checkpoint_interval,
            "checkpoint_interval_s": round(i.checkpoint_interval * t, 1),
            "group_restart_s": i.group_restart_s,
            "stall_s": i.stall_s,
            "quorum_ms": i.quorum_ms,
            "sync_every": i.sync_every,
        },
    }
    lost = {"checkpoint_restarts": _sig(ft.restarts_lost_per_day)}
    if ft.modes is None:
        out["note"] = no_groups_line(ft)
        return {
            **out,
            **dict.fromkeys(MODES),
            "break_even_gpus": None,
            "gpu_hours_lost_per_day": {**lost, **dict.fromkeys(MODES)},
        }
    return {
        **out,
        "sum_in_backward": ft.sum_in_backward,
        "cross_group_sum_seconds": round(ft.sum_seconds, 4),
        "after_backward_seconds": round(ft.after_backward, 4),
        **{name: round(m.fraction, 5) for name, m in ft.modes.items()},
        "per_step_seconds": {name: round(m.seconds, 5) for name, m in ft.modes.items()},
        "break_even_gpus": {name: m.break_even_gpus for name, m in ft.modes.items()},
        "gpu_hours_lost_per_day": {
            **lost,
            **{name: _sig(m.lost_per_day) for name, m in ft.modes.items()},
        },
    }


def no_groups_line(ft: FaultTolerance) -> str:
    """What a layout without replica groups gets instead of their numbers."""
    return (
        f"no replica groups: the layout {ft.candidate.key} has dp_replicate = 1 (replica groups "
        "are its dp_replicate slices); checkpoint restarts lose "
        f"{ft.restarts_lost_per_day:.3g} GPU-hours a day"
    )


def text_lines(ft: FaultTolerance) -> list[str]:
    """The human section after the plan: per-step cost, GPU-hours lost, break-even."""
    i, t = ft.inputs, ft.candidate.step.seconds
    if ft.modes is None:
        return [f"fault tolerance: {no_groups_line(ft)}"]
    lines = [
        f"fault tolerance on #1 ({ft.candidate.key}): {ft.groups} replica groups of "
        f"{ft.group_gpus} GPUs, step t = {t:.3f} s; {i.failures_per_gpu_hour:.2g} failures per "
        f"GPU-hour, restart {i.restart_s:g} s, checkpoint every {i.checkpoint_interval} steps "
        f"({i.checkpoint_interval * t:,.0f} s), group restart {i.group_restart_s:g} s, "
        f"survivors' stall {i.stall_s:g} s, quorum {i.quorum_ms:g} ms",
        "",
    ]
    rows = [["checkpoint restarts", "-", "-", f"{ft.restarts_lost_per_day:,.3g}", "-"]]
    labels = {"every_step": "every-step sync", "diloco": f"DiLoCo, H = {i.sync_every}"}
    for name, m in ft.modes.items():
        even = "never" if m.break_even_gpus is None else f"{m.break_even_gpus:,}"
        rows.append(
            [
                labels[name],
                f"{m.seconds:.4f} s",
                f"{m.fraction:.2%}",
                f"{m.lost_per_day:,.3g}",
                even,
            ]
        )
    columns = [
        ("", "<"),
        ("per step", ">"),
        ("of the step", ">"),
        ("GPU-hours lost a day", ">"),
        ("break-even GPUs", ">"),
    ]
    lines += table(columns, rows)
    where = (
        "in the backward (FSDP's all-reduce hook) but for the root unit's share, "
        f"{ft.after_backward:.4f} s after it"
        if ft.sum_in_backward
        else "after the backward, all of it exposed (expert parallel, or one-GPU groups: no FSDP)"
    )
    lines += [
        "",
        f"every-step sync: the cross-group gradient sum ({ft.sum_seconds:.4f} s) runs {where}; "
        "break-even: the GPU count (groups of this size added) above which replica groups lose "
        "less; docs/fault_tolerance.md gives the model",
    ]
    return lines


def _sig(value: float) -> float:
    """Four significant digits: GPU-hours a day span from thousandths to thousands."""
    return float(f"{value:.4g}")
