"""Start-up checks that need no GPU and no process group, shared by `kiln check` and nothing
else: what `kiln train` would refuse at start-up (a missing dataset, a tokenizer larger than the
model's vocabulary, a missing checkpoint to load, a run directory of another config, an unwritable
checkpoint directory) is reported before a job is queued."""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.checkpoint.fingerprint import run_fingerprint
from kiln.checkpoint.manager import CheckpointManager, StartKind
from kiln.config import JobConfig, resolve_layout
from kiln.config.sections import DatasetSource
from kiln.data.sources import dataset_entries, open_data
from kiln.errors import ConfigError, KilnError
from kiln.events import EventLog


def preflight(cfg: JobConfig, world_size: int) -> list[str]:
    """Notes on what training will do at start-up; raises ConfigError listing every problem."""
    notes, problems = start_up_checks(cfg, world_size)
    if problems:
        problems.append("(kiln check --config-only checks the recipe and layout alone)")
        raise ConfigError.listing(problems, "at start-up")
    return notes


def start_up_checks(cfg: JobConfig, world_size: int) -> tuple[list[str], list[str]]:
    """Notes on what training will do at start-up, and every problem that would stop it."""
    problems, notes = [], []
    for check in (_data_notes, _checkpoint_notes):
        try:
            notes += check(cfg, world_size)
        except KilnError as error:
            problems.append(str(error))
    return notes, problems


def _data_notes(cfg: JobConfig, world_size: int) -> list[str]:
    built_at_start = [
        entry
        for entry in dataset_entries(cfg.data)
        if (entry.source == "demo" and not Path(entry.path).is_dir())
        or (entry.source == "hf" and not entry.streaming)
    ]
    if built_at_start:
        return [
            f"{_data_label(cfg, entry)}: {entry.source} data, built on the first start; "
            "checked then"
            for entry in built_at_start
        ]
    cache = Path(cfg.metrics.run_dir) / "data_cache"
    _, eval_data = open_data(cfg, cache_dir=cache)
    notes = [
        f"{_data_label(cfg, entry)}: opened, its vocabulary fits model.vocab_size"
        for entry in dataset_entries(cfg.data)
    ]
    if eval_data is not None:
        notes.append(f"eval data: {eval_data.path}")
    return notes


def _data_label(cfg: JobConfig, entry: DatasetSource) -> str:
    """'data (data/demo)' for a plain [data] section, 'dataset web (data/web)' in a mixture."""
    where = entry.path or f"{entry.source} dataset"
    return f"dataset {entry.name} ({where})" if cfg.data.datasets else f"data ({where})"


def _checkpoint_notes(cfg: JobConfig, world_size: int) -> list[str]:
    checkpoints = CheckpointManager(
        cfg, device=torch.device("cpu"), events=EventLog(Path(cfg.metrics.run_dir), enabled=False)
    )
    checkpoints.check_sources()
    checkpoints.probe_writable()
    layout = resolve_layout(cfg.distributed, world_size)
    data_ranks = layout["dp_replicate"] * layout["dp_shard"] * layout["ep"]
    global_batch = cfg.train.batch_size * cfg.train.grad_accum_steps * data_ranks
    start = checkpoints.start_point(run_fingerprint(cfg, global_batch=global_batch))
    check_stop_at_step(cfg, start.step)
    held = checkpoints.holder()
    owner = [] if held is None else [f"checkpoints: {checkpoints.dir} is held now by {held}"]
    if start.kind is StartKind.SCRATCH:
        return [f"checkpoints: a new run in {checkpoints.dir}", *owner]
    return [f"checkpoints: {start.kind} from {start.path} (step {start.step})", *owner]


def check_stop_at_step(cfg: JobConfig, start_step: int) -> None:
    """train.stop_at_step must lie ahead of where the run resumes."""
    if cfg.train.stop_at_step and cfg.train.stop_at_step <= start_step:
        raise ConfigError(
            f"train.stop_at_step = {cfg.train.stop_at_step} but this run resumes at step "
            f"{start_step}: nothing to train. Raise train.stop_at_step or leave it out"
        )
