"""FSDP's all-gather and reduce-scatter through shared memory, for CPU ranks on one host.

On CPU, gloo moves every byte of FSDP's traffic through TCP loopback, on the same cores that
compute: each step of a model gathers its parameters twice and reduces its gradients once, and
gloo's reduce-scatter is an all-reduce of the whole buffer (benchmarks/fsdp_overhead.md). Here the
ranks of a group map one buffer in /dev/shm instead: each rank copies its part in, the group passes
a one-element gloo all-reduce (the fence), and each rank copies out (or sums) what it needs.

The buffer has two halves used in turn, so one fence per piece suffices: a rank writes a half
again only after passing the fence of the piece in between, which every rank enters only after
it has read the half. The halves have a fixed size; larger collectives go in pieces.

Every rank of a group sees the same collective sizes in the same order (FSDP pads shards to equal
sizes), so the buffer is created lazily, at the group's first collective, on its rank 0, and the
other ranks check that they see that rank's file before the group uses it: ranks on different
hosts (or containers with separate /dev/shm), or a /dev/shm without room, fall back to gloo, all
together.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

# Both halves of a group's buffer together, at most; each rank's slot is this over 2 x ranks.
BUFFER_BYTES = 128 * 2**20
ALIGNMENT = 64


class SharedMemoryGroup:
    """The shared buffer of one process group (`halves`), or None where its ranks cannot share
    one. Each rank's slot holds `slot_bytes` (a multiple of ALIGNMENT)."""

    def __init__(self, group: dist.ProcessGroup, slot_bytes: int) -> None:
        self.group = group
        self.ranks = group.size()
        self.rank = group.rank()
        self.slot_bytes = slot_bytes
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._pieces = 0
        self.halves = self._map_buffer()

    def next_half(self) -> torch.Tensor:
        """uint8 (ranks, slot_bytes): row r is rank r's slot, for the next piece."""
        half = self.halves[self._pieces % 2]
        self._pieces += 1
        return half

    def fence(self) -> None:
        dist.all_reduce(self._flag, group=self.group)

    def _map_buffer(self) -> torch.Tensor | None:
        # Rank 0 decides where the buffer lives (or why it cannot) and tells the group.
        decision: list[str | None] = [None]
        if self.rank == 0:
            decision[0] = _create_buffer_file(2 * self.ranks * self.slot_bytes)
        dist.broadcast_object_list(decision, group=self.group, group_src=0)
        path = decision[0]
        if path.startswith("error: "):
            if self.rank == 0:
                print(
                    f"kiln: WARNING: FSDP's collectives stay on gloo (slower on CPU): no room for "
                    f"their shared-memory buffer, {path[7:]}. Give /dev/shm more room (docker "
                    "run --shm-size=1g), or set distributed.shared_memory_collectives = false",
                    file=sys.stderr,
                    flush=True,
                )
            return None
        # Only a rank that sees rank 0's file may map it: mapping a missing path creates a
        # private file, which would silently share nothing.
        seen = torch.tensor([1 if os.path.exists(path) else 0], dtype=torch.int32)
        mapped = None
        if seen.item():
            size = 2 * self.ranks * self.slot_bytes
            mapped = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        dist.all_reduce(seen, op=dist.ReduceOp.MIN, group=self.group)
        if self.rank == 0:
            os.unlink(path)  # the mappings keep the memory; nothing is left behind on exit
        if not seen.item():
            return None
        return mapped.view(2, self.ranks, self.slot_bytes)


def _create_buffer_file(nbytes: int) -> str:
    """A file of `nbytes` whose memory is reserved now (so a full /dev/shm fails here, not with
    SIGBUS later), as its path, or 'error: <why>'."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    descriptor, path = tempfile.mkstemp(prefix="kiln-fsdp-", dir=directory)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(descriptor, 0, nbytes)
        else:  # macOS: no way to reserve; the size at least
            os.ftruncate(descriptor, nbytes)
    except OSError as error:
        os.unlink(path)
        return f"error: {nbytes / 2**20:.0f} MiB in {directory}: {error.strerror}"
    finally:
        os.close(descriptor)
    return path


class SharedMemoryBuffers:
    """The buffers of the groups the collectives have used, one per group, created at the group's
    first collective: slots of `largest_bytes` (a collective's share of one rank; larger ones go
    in pieces), or of what BUFFER_BYTES allows for the group if that is less."""

    def __init__(self, largest_bytes: int) -> None:
        self.largest_bytes = largest_bytes
        self._groups: dict[dist.ProcessGroup, SharedMemoryGroup] = {}

    def of(self, group: dist.ProcessGroup) -> SharedMemoryGroup | None:
        if group not in self._groups:
            most = BUFFER_BYTES // (2 * group.size())
            # At least one 8-byte element per rank in a reduce-scatter's piece.
            least = ALIGNMENT * group.size()
            slot_bytes = -(-max(least, min(self.largest_bytes, most)) // ALIGNMENT) * ALIGNMENT
            self._groups[group] = SharedMemoryGroup(group, slot_bytes)
        found = self._groups[group]
        return found if found.halves is not None else None


class SharedMemoryComm:
    """Base of the two collectives; both use the same buffers."""

    def __init__(self, buffers: SharedMemoryBuffers) -> None:
        self.buffers = buffers

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class SharedMemoryAllGather(SharedMemoryComm, AllGather):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        shared = self.buffers.of(group)
        if shared is None:
            return dist.all_gather_single(output_tensor, input_tensor, group, async_op)
        sent = input_tensor.reshape(-1).view(torch.uint8)
        gathered = output_tensor.view(torch.uint8).view(shared.ranks, sent.numel())
        me = shared.rank
        # FSDP copies its shard into its row of the output before the call: no need to copy it.
        in_place = sent.data_ptr() == gathered[me].data_ptr()
        rows = (slice(0, me), slice(me + 1, None)) if in_place else (slice(None),)
        for start in range(0, sent.numel(), shared.slot_bytes):
            end = min(start + shared.slot_bytes, sent.numel())
            half = shared.next_half()[:, : end - start]
            half[me].copy_(sent[start:end])
            shared.fence()
            for row in rows:
                gathered[row, start:end].copy_(half[row])
        return None


class SharedMemoryReduceScatter(SharedMemoryComm, ReduceScatter):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        shared = self.buffers.of(group)
        if shared is None or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return dist.reduce_scatter_single(output_tensor, input_tensor, op, group, async_op)
        ranks, size, me = shared.ranks, output_tensor.numel(), shared.rank
        chunks = input_tensor.view(ranks, size)  # chunk r is rank r's share
        itemsize = input_tensor.element_size()
        piece = shared.slot_bytes // (ranks * itemsize)
        for start in range(0, size, piece):
            end = min(start + piece, size)
            half = shared.next_half()[:, : ranks * (end - start) * itemsize]
            slots = half.view(input_tensor.dtype).view(ranks, ranks, end - start)
            mine = chunks[:, start:end]
            # Row s of this rank's slot is what rank s sums; its own share it reads in place.
            slots[me, :me].copy_(mine[:me])
            slots[me, me + 1 :].copy_(mine[me + 1 :])
            shared.fence()
            received = [mine[me] if s == me else slots[s, me] for s in range(ranks)]
            # Summed in rank order: the same order on every rank, whatever the layout.
            out = output_tensor[start:end]
            if ranks == 1:
                out.copy_(received[0])
            else:
                torch.add(received[0], received[1], out=out)
            for row in received[2:]:
                out.add_(row)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(ranks)
        return None


def use_shared_memory_collectives(
    parts: list[nn.Module], buffers: SharedMemoryBuffers | None = None
) -> None:
    """Route the all-gathers and reduce-scatters of every FSDP unit in `parts` through shared
    memory (CPU only; call after the last `fully_shard`). `buffers` None: slots as large as the
    model's fp32 parameters, if the cap allows (a small model's buffers cost little to create)."""
    if buffers is None:
        model_bytes = 4 * sum(p.numel() for part in parts for p in part.parameters())
        buffers = SharedMemoryBuffers(largest_bytes=model_bytes)
    gather, reduce = SharedMemoryAllGather(buffers), SharedMemoryReduceScatter(buffers)
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(gather)
                module.set_custom_reduce_scatter(reduce)
