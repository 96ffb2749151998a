"""The flight recorder: each rank's record of its last collectives, written when a collective
fails or the step watchdog fires, and a summary of which rank is behind in which collective.

torch keeps the record itself (torch 2.13: gloo's collectives in its CPU flight recorder, on by
default, the last TORCH_FR_BUFFER_SIZE = 2000; NCCL's in its own): per collective its process
group, a sequence number per group, the operation and the tensor sizes. kiln writes it as JSON to
`<run_dir>/flight_recorder/rank_<r>.json` with the rank, its host and each group's ranks and mesh
dimension, then summarizes every dump of the same attempt into `summary.txt`. The hung rank
cannot: every rank that dumps rewrites the summary from all the dumps it finds, so the last one
written (the hung rank's, when its watchdog fires, or a waiting rank's) sees the most.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from kiln.log import warn
from kiln.resilience.hang_summary import summarize

FOLDER = "flight_recorder"
SUMMARY = "summary.txt"
# A rank that dumped waits this long for the others' dumps before summarizing: ranks that fail in
# the same collective dump within moments of each other, and a summary of all of them is wanted.
GATHER_WAIT_S = 5.0
# What kiln keeps of each of torch's entries (torch's JSON carries stack traces and more).
ENTRY_FIELDS = (
    "record_id",
    "collective_seq_id",
    "p2p_seq_id",
    "is_p2p",
    "process_group",
    "profiling_name",
    "input_sizes",
    "state",
    "retired",
    "time_created_ns",
)


@dataclass
class _Recorder:
    folder: Path
    rank: int
    world_size: int
    hosts: list[str]
    attempt: str  # rank 0's id for this start of the job, so dumps of earlier ones are ignored
    cuda: bool
    summary: str | None = None  # once dumped: a process dumps once


_installed: _Recorder | None = None
# The failing collective's handler and the step watchdog may both dump: the second one waits for
# the first and keeps its dump (the watchdog then ends the process).
_dumping = threading.Lock()


def prepare(run_dir: Path, device: torch.device) -> None:
    """Before the process group exists: on CUDA, keep torch's NCCL flight recorder on and have its
    own dump on a timeout (NCCL's watchdog may end the process before kiln can dump) written under
    the run directory. What the user set in the environment is kept."""
    if device.type != "cuda" or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return
    folder = Path(run_dir) / FOLDER
    buffer = os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", buffer)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(folder / "nccl_rank_"))
    folder.mkdir(parents=True, exist_ok=True)  # torch writes its dump there but does not create it


def install(run_dir: Path, *, distributed: bool, cuda: bool) -> list[str]:
    """After the process group exists: learn every rank's host and the attempt's id (one
    all-gather), so that this process can dump; returns the hosts in rank order."""
    global _installed
    host = socket.gethostname()
    if not distributed:
        _installed = None
        return [host]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (host, uuid.uuid4().hex))
    hosts = [h for h, _ in gathered]
    _installed = _Recorder(
        folder=Path(run_dir) / FOLDER,
        rank=dist.get_rank(),
        world_size=len(hosts),
        hosts=hosts,
        attempt=gathered[0][1],
        cuda=cuda,
    )
    return hosts


def dump(reason: str) -> str | None:
    """Write this rank's record, then the summary of every dump of this attempt (also warned);
    returns the summary, or None where nothing is installed (one process)."""
    rec = _installed
    if rec is None:
        return None
    with _dumping:
        if rec.summary is None:
            rec.summary = _dump(rec, reason)
    return rec.summary


def _dump(rec: _Recorder, reason: str) -> str:
    rec.folder.mkdir(parents=True, exist_ok=True)
    record = {
        "rank": rec.rank,
        "host": rec.hosts[rec.rank],
        "hosts": rec.hosts,
        "attempt": rec.attempt,
        "reason": reason,
        "time_ns": time.time_ns(),
        "groups": _groups(),
        "entries": _torch_entries(rec.cuda),
    }
    _write_atomically(rec.folder / f"rank_{rec.rank}.json", json.dumps(record))
    dumps = _wait_for_dumps(rec)
    text = summarize(dumps, world_size=rec.world_size, hosts=rec.hosts)
    _write_atomically(rec.folder / SUMMARY, text + "\n")
    warn(f"flight recorder, rank {rec.rank} ({rec.folder}):\n{text}")
    return text


def read_dumps(folder: Path, attempt: str | None = None) -> list[dict]:
    """The dumps in `folder` of `attempt` (None: that of the newest file; older attempts' dumps
    are left out, as their ranks' files are replaced only when they dump again)."""
    paths = sorted(Path(folder).glob("rank_*.json"), key=_modified)
    dumps = []
    for path in paths:
        try:
            dumps.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # replaced or removed meanwhile: summarize the others
    if dumps and attempt is None:
        attempt = dumps[-1]["attempt"]
    return sorted((d for d in dumps if d["attempt"] == attempt), key=lambda d: d["rank"])


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _wait_for_dumps(rec: _Recorder) -> list[dict]:
    deadline = time.monotonic() + GATHER_WAIT_S
    while True:
        dumps = read_dumps(rec.folder, rec.attempt)
        if len(dumps) >= rec.world_size or time.monotonic() > deadline:
            return dumps
        time.sleep(0.1)


def _torch_entries(cuda: bool) -> list[dict]:
    """torch's record of this process's last collectives (NCCL's on CUDA), oldest first."""
    c10d = torch._C._distributed_c10d
    dump_json = getattr(c10d, "_dump_nccl_trace_json", None) if cuda else None
    raw = (dump_json or c10d._dump_fr_trace_json)(includeCollectives=True, onlyActive=False)
    entries = json.loads(raw).get("entries", [])  # none: TORCH_FR_BUFFER_SIZE=0 turned it off
    return [{key: entry.get(key) for key in ENTRY_FIELDS} for entry in entries]


def _groups() -> dict[str, dict]:
    """Every process group this rank is in, by name (the name torch's entries carry): its
    description (`mesh_<dims>` for the mesh's) and its global ranks."""
    names = dist.distributed_c10d._world.pg_names
    return {
        name: {"desc": getattr(pg, "group_desc", ""), "ranks": dist.get_process_group_ranks(pg)}
        for pg, name in names.items()
    }


def _write_atomically(path: Path, text: str) -> None:
    # Another rank may read the folder at any moment: it sees the old file or the new one.
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)
