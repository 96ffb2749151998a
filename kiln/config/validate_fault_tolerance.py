"""Problems with [fault_tolerance], found before anything is built or any process starts."""

from __future__ import annotations

import importlib.util

from kiln.config.sections import JobConfig


def job_world_size(cfg: JobConfig, launched: int) -> int:
    """The job's processes when torchrun launched `launched`: under fault tolerance that is one
    replica group, and the job is distributed.dp_replicate of them."""
    return launched * cfg.distributed.dp_replicate if cfg.fault_tolerance.enabled else launched


def fault_tolerance_problems(cfg: JobConfig) -> list[str]:
    ft, groups, p = cfg.fault_tolerance, cfg.distributed.dp_replicate, []
    if not ft.enabled:
        if ft.sync == "diloco":
            p.append(
                'fault_tolerance.sync = "diloco" needs fault_tolerance.enabled = true: DiLoCo '
                "synchronizes replica groups (each dp_replicate slice a torchrun job of its "
                'own). Turn fault_tolerance.enabled on, or set sync = "every_step"'
            )
        return p
    if groups < 2:
        return [
            "fault_tolerance.enabled needs distributed.dp_replicate >= 2: each dp_replicate "
            "slice is a replica group that can die and rejoin while the others train, and with "
            f"dp_replicate = {groups} there is no other group to train on. Set "
            "distributed.dp_replicate to the number of groups (each a torchrun job of its own), "
            "or turn fault_tolerance.enabled off"
        ]
    if not 0 <= ft.replica_group < groups:
        p.append(
            f"fault_tolerance.replica_group = {ft.replica_group} is not one of the "
            f"{groups} groups (0 .. {groups - 1}, distributed.dp_replicate = {groups}): give "
            "each group's launch its own --fault_tolerance.replica_group"
        )
    if not 1 <= ft.min_replicas <= groups:
        p.append(
            f"fault_tolerance.min_replicas must be between 1 and distributed.dp_replicate "
            f"({groups}), got {ft.min_replicas}: steps commit only while that many groups live"
        )
    for key in ("quorum_timeout_s", "timeout_s", "recovery_timeout_s", "connect_timeout_s"):
        if getattr(ft, key) <= 0:
            p.append(f"fault_tolerance.{key} must be > 0 seconds, got {getattr(ft, key)}")
    if ft.max_failed_steps < 1:
        p.append(f"fault_tolerance.max_failed_steps must be >= 1, got {ft.max_failed_steps}")
    if cfg.checkpoint.async_mode != "disabled":
        p.append(
            "fault_tolerance.enabled saves checkpoints synchronously only: the group that writes "
            "them can change between steps (a group that rejoins may take over), and a new "
            "writer's save would remove the other's save still in flight. Set "
            'checkpoint.async_mode = "disabled"'
        )
    if cfg.resilience.nan_action == "rollback":
        p.append(
            "fault_tolerance.enabled skips non-finite steps and stops after "
            "resilience.nan_max_consecutive; rolling back to a checkpoint is not supported "
            "across replica groups. Set resilience.nan_action = 'stop'"
        )
    if cfg.model.moe.num_experts and cfg.model.moe.bias_update_rate > 0:
        p.append(
            "fault_tolerance.enabled does not support model.moe.bias_update_rate > 0 yet: each "
            "group would move its expert biases by its own token counts and the groups' "
            "routing would drift apart. Set model.moe.bias_update_rate = 0 (the auxiliary "
            "load-balancing loss still applies)"
        )
    if _streams(cfg):
        p.append(
            "fault_tolerance.enabled reads prepared (or tokenized) datasets only: a streamed "
            "dataset's position lives on the ranks that read it, and a group that rejoins "
            "could not take it from a peer. Prepare the data (kiln prepare) or set "
            "data.streaming = false"
        )
    if ft.sync == "diloco":
        p += _diloco_problems(cfg)
    # Looked up, not imported: validation does not pay for torchft's import.
    if importlib.util.find_spec("torchft") is None:
        p.append(
            "fault_tolerance.enabled needs the torchft package, which is not installed: "
            "pip install 'kiln[ft]'"
        )
    return p


def _streams(cfg: JobConfig) -> bool:
    return cfg.data.streaming or any(d.streaming for d in cfg.data.datasets)


def _diloco_problems(cfg: JobConfig) -> list[str]:
    ft, p = cfg.fault_tolerance, []
    if ft.sync_every < 1 or ft.fragments < 1:
        return [
            f"fault_tolerance.sync_every ({ft.sync_every}) and fragments ({ft.fragments}) must "
            "be >= 1 (inner steps between syncs; runs of blocks that sync in turn)"
        ]
    if ft.sync_every < ft.fragments:
        p.append(
            f"fault_tolerance.sync_every = {ft.sync_every} is below fault_tolerance.fragments = "
            f"{ft.fragments}: each fragment syncs once every sync_every steps, one fragment at a "
            "time. Raise sync_every to a multiple of fragments, or lower fragments"
        )
    elif ft.sync_every % ft.fragments:
        good = ft.sync_every + ft.fragments - ft.sync_every % ft.fragments
        p.append(
            f"fault_tolerance.sync_every = {ft.sync_every} is not a multiple of "
            f"fault_tolerance.fragments = {ft.fragments}: the fragments sync every sync_every / "
            f"fragments steps. Use e.g. sync_every = {good}"
        )
    elif not 0 <= ft.fragment_sync_delay < ft.sync_every // ft.fragments:
        p.append(
            f"fault_tolerance.fragment_sync_delay = {ft.fragment_sync_delay} must be in 0 .. "
            f"sync_every / fragments - 1 = {ft.sync_every // ft.fragments - 1}: a fragment's "
            "sync must finish before the next one starts"
        )
    if ft.fragments > cfg.model.n_layers:
        p.append(
            f"fault_tolerance.fragments = {ft.fragments} exceeds the model's {cfg.model.n_layers} "
            "blocks: a fragment needs at least one block"
        )
    if ft.outer_lr <= 0 or not 0 <= ft.outer_momentum < 1:
        p.append(
            f"fault_tolerance.outer_lr must be > 0 and outer_momentum in [0, 1), got "
            f"{ft.outer_lr} and {ft.outer_momentum} (DiLoCo's: 0.7 and 0.9)"
        )
    if cfg.optimizer.name == "schedule_free_adamw":
        p.append(
            'optimizer.name = "schedule_free_adamw" cannot run under fault_tolerance.sync = '
            '"diloco": its weights interpolate two sequences its state holds, and the outer '
            "step overwrites the weights every sync_every steps, leaving them inconsistent. "
            "Use adamw, muon or lion"
        )
    interval = ft.sync_every // ft.fragments
    if interval and cfg.checkpoint.interval % interval:
        p.append(
            f"checkpoint.interval = {cfg.checkpoint.interval} is not a multiple of sync_every / "
            f'fragments = {interval} under fault_tolerance.sync = "diloco": checkpoints are '
            "taken between syncs, with no sync in flight"
        )
    return p
