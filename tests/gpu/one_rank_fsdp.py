"""`kiln train` on one rank with a real process group and FSDP, started by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 1 tests/gpu/one_rank_fsdp.py \
        train RECIPE [OVERRIDES]

A job of one process never creates a process group (kiln/parallel/mesh.py) and FSDP shards
only over more than one rank, so on a machine with one GPU the NCCL path never runs. This
driver patches, from outside, what that decides: the process group is created all the same
(NCCL on CUDA, gloo on the CPU) with the six-dimension mesh of size 1, and FSDP shards over its
one-rank dp_shard dimension. Every collective kiln issues then goes through that group: the
token count, the step's flags, FSDP's all-gathers and reduce-scatters, the checkpoint's.
It prints what ran (`backend=...`, `fsdp_units=...`) for the test to check.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule

import kiln.parallel.apply as apply_module
import kiln.train.trainer as trainer_module
from kiln.cli import main
from kiln.config.sections import JobConfig
from kiln.config.validate import resolve_layout
from kiln.parallel.mesh import MESH_DIMS, ParallelContext, _restart_safe_store


class OneRankFSDP(ParallelContext):
    """One rank that FSDP shards over all the same (its dp_shard mesh of one)."""

    def fsdp_mesh(self) -> DeviceMesh | None:
        return self.mesh["dp_shard"]


def init_one_rank(cfg: JobConfig, device: torch.device) -> ParallelContext:
    """kiln's `init_training_parallel` without its shortcut for one process."""
    if device.type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=cfg.resilience.collective_timeout_s)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        timeout=timeout,
        **_restart_safe_store(1, timeout),
    )
    mesh = init_device_mesh(device.type, (1,) * len(MESH_DIMS), mesh_dim_names=MESH_DIMS)
    print(f"backend={dist.get_backend()}", flush=True)
    degrees = resolve_layout(cfg.distributed, 1)
    return OneRankFSDP(rank=0, world_size=1, device=device, degrees=degrees, mesh=mesh)


def apply_and_count(*args, **kwargs) -> list:
    """kiln's apply_parallelism, then the count of FSDP units it made."""
    parts = apply_parallelism(*args, **kwargs)
    units = sum(isinstance(m, FSDPModule) for part in parts for m in part.modules())
    print(f"fsdp_units={units}", flush=True)
    return parts


apply_parallelism = apply_module.apply_parallelism

if __name__ == "__main__":
    # The trainer looks these up in its own module and in kiln/parallel/apply.py at call time.
    trainer_module.init_training_parallel = init_one_rank
    apply_module.apply_parallelism = apply_and_count
    sys.exit(main(sys.argv[1:]))
