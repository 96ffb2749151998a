"""Process group and DeviceMesh from [distributed]: dims `pp, dp_replicate, dp_shard, ep, cp, tp`.

tp is innermost so that, with ranks numbered node by node, a tensor-parallel group stays
inside one node.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kiln.config.sections import DistributedConfig, JobConfig
from kiln.config.validate import resolve_layout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")


@dataclass
class ParallelContext:
    """Where this process sits in the job. A single process has no mesh and no process group."""

    rank: int
    world_size: int
    device: torch.device
    degrees: dict[str, int]
    mesh: DeviceMesh | None = None
    # Under fault tolerance the dp_replicate slices are torchft replica groups, each a job of
    # its own: `degrees` and `mesh` are this group's (dp_replicate 1), `world_size` its ranks.
    replica_group: int = 0
    replica_groups: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def job_world_size(self) -> int:
        """Every process of the job: under fault tolerance, every replica group's."""
        return self.world_size * self.replica_groups

    @property
    def data_ranks(self) -> int:
        """Ranks that read different samples (tp/cp/pp ranks of one replica read the same ones)."""
        return self.group_data_ranks * self.replica_groups

    @property
    def group_data_ranks(self) -> int:
        """The data ranks of this process's replica group (all of them without fault tolerance)."""
        return self.degrees["dp_replicate"] * self.degrees["dp_shard"] * self.degrees["ep"]

    @property
    def token_ranks(self) -> int:
        """Ranks whose gradients are summed: the data ranks and the cp ranks (other parts of
        the same sequences; tp ranks' are reduced by tensor parallel itself)."""
        return self.data_ranks * self.degrees["cp"]

    @property
    def data_rank(self) -> int:
        """Numbered as under HSDP: replica group (or dp_replicate slice), dp_shard, ep."""
        if self.mesh is None:
            return self.replica_group * self.group_data_ranks
        coords = {
            name: self.mesh.get_local_rank(name) for name in ("dp_replicate", "dp_shard", "ep")
        }
        in_group = (
            coords["dp_replicate"] * self.degrees["dp_shard"] + coords["dp_shard"]
        ) * self.degrees["ep"] + coords["ep"]
        return self.replica_group * self.group_data_ranks + in_group

    def fsdp_mesh(self) -> DeviceMesh | None:
        """The FSDP mesh of the dense parameters: over the ranks that hold different tokens and
        shard (dp_shard; ep, whose ranks read other batches; cp, whose ranks hold other parts of
        the sequences), 1-D for FSDP, 2-D (dp_replicate, shard) for HSDP; None if unsharded."""
        if self.mesh is None or self.token_ranks == 1:
            return None
        return self._with_replicate(self._flat(("dp_shard", "ep", "cp")))

    def data_group(self) -> dist.ProcessGroup | None:
        """Group over which per-rank token counts and losses are summed (the cp ranks' too)."""
        fsdp_mesh = self.fsdp_mesh()
        if fsdp_mesh is None:
            return None
        return (
            fsdp_mesh.get_group() if fsdp_mesh.ndim == 1 else fsdp_mesh._flatten("dp").get_group()
        )

    def sequence_fsdp_mesh(self) -> DeviceMesh | None:
        """The FSDP mesh of units that tensor parallel leaves whole (the plan's
        `block_sequence_units`): each tp rank runs them on its own part of the sequence, so they
        are sharded over the data, cp and tp ranks together: 1-D (dp_shard × ep × cp × tp), or
        2-D (dp_replicate, dp_shard × ep × cp × tp) for HSDP. None without tensor parallel."""
        if self.mesh is None or self.degrees["tp"] == 1:
            return None
        return self._with_replicate(self._flat(("dp_shard", "ep", "cp", "tp")))

    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """The FSDP mesh of expert weights under expert parallel: each ep rank holds its own
        experts, sharded over the other ranks holding different tokens (dp_shard × cp × tp), 2-D
        with dp_replicate for HSDP (a mesh of one rank when there are none). None without ep."""
        if self.mesh is None or self.degrees["ep"] == 1:
            return None
        return self._with_replicate(self._flat(("dp_shard", "cp", "tp")))

    def ep_mesh(self) -> DeviceMesh | None:
        if self.mesh is None or self.degrees["ep"] == 1:
            return None
        return self.mesh["ep"]

    def token_group(self) -> dist.ProcessGroup | None:
        """Group of the ranks that hold different tokens of one micro-batch on this pipeline
        rank: the data ranks (ep included), the cp and the tp ranks (other parts of the same
        sequences). Statistics of the whole micro-batch (MoE expert loads) are summed over it."""
        if self.mesh is None or self.degrees["tp"] == 1:
            return self.data_group()
        return self._flat(("dp_replicate", "dp_shard", "ep", "cp", "tp")).get_group()

    def sequence_group(self) -> dist.ProcessGroup | None:
        """Group of the ranks holding the other parts of this rank's sequences (cp and tp)."""
        if self.mesh is None or self.degrees["cp"] * self.degrees["tp"] == 1:
            return None
        return self._flat(("cp", "tp")).get_group()

    def cp_mesh(self) -> DeviceMesh | None:
        if self.mesh is None or self.degrees["cp"] == 1:
            return None
        return self.mesh["cp"]

    def _flat(self, dims: tuple[str, ...]) -> DeviceMesh:
        """`dims` of the mesh flattened into one, named after them (the dim itself if one)."""
        kept = tuple(d for d in dims if self.degrees[d] > 1) or dims[:1]
        if len(kept) == 1:
            return self.mesh[kept[0]]
        return self.mesh[kept]._flatten("_".join(kept))

    def _with_replicate(self, shard: DeviceMesh) -> DeviceMesh:
        if self.degrees["dp_replicate"] == 1:
            return shard
        return self.mesh["dp_replicate", shard.mesh_dim_names[0]]


def init_parallel(
    dist_cfg: DistributedConfig,
    device: torch.device,
    *,
    timeout_s: float = 600,
    replica_group: int | None = None,
) -> ParallelContext:
    """Join the job torchrun started (WORLD_SIZE, RANK, LOCAL_RANK) and build the mesh.

    gloo on CPU, NCCL on GPU; one process skips the process group entirely. With
    `replica_group` (fault tolerance) the job torchrun started is that one replica group of
    dist_cfg.dp_replicate, and the mesh spans it alone.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    groups = {}
    if replica_group is not None:
        groups = {"replica_group": replica_group, "replica_groups": dist_cfg.dp_replicate}
        dist_cfg = replace(dist_cfg, dp_replicate=1)
    degrees = resolve_layout(dist_cfg, world_size)
    if world_size == 1:
        return ParallelContext(rank=0, world_size=1, device=device, degrees=degrees, **groups)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=timeout,
            **_restart_safe_store(world_size, timeout),
        )
    mesh = init_device_mesh(
        device.type,
        tuple(degrees[d] for d in MESH_DIMS),
        mesh_dim_names=MESH_DIMS,
    )
    return ParallelContext(
        rank=dist.get_rank(),
        world_size=world_size,
        device=device,
        degrees=degrees,
        mesh=mesh,
        **groups,
    )


def init_training_parallel(cfg: JobConfig, device: torch.device) -> ParallelContext:
    """init_parallel for a training run: its collective timeout, its replica group."""
    ft = cfg.fault_tolerance
    return init_parallel(
        cfg.distributed,
        device,
        timeout_s=cfg.resilience.collective_timeout_s,
        replica_group=ft.replica_group if ft.enabled else None,
    )


def _restart_safe_store(world_size: int, timeout: datetime.timedelta) -> dict:
    """Under torchrun, the store of the launcher with a prefix per restart attempt. torch 2.13's
    launcher keeps one store across `--max-restarts` attempts, and without the prefix a restarted
    worker can read the address a dead worker of the previous attempt published and fail to
    connect. Outside torchrun: the default env:// rendezvous."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {
        "store": dist.PrefixStore(f"kiln/attempt_{attempt}", client),
        "rank": int(os.environ["RANK"]),
        "world_size": world_size,
    }
