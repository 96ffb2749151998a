"""FSDP's all-gather and reduce-scatter through shared memory, for CPU ranks on one host.

On CPU, gloo moves every byte of FSDP's traffic through TCP loopback, on the same cores that
compute (benchmarks/fsdp_overhead.md). Here the ranks of a group map one arena in /dev/shm
instead: one row per rank, and beside each row a counter of the collectives whose data that rank
has written. A collective takes the next bytes of every row (the same bytes on every rank: each
rank sees the same collective sizes in the same order, FSDP pads shards to equal sizes); a rank
copies its part into its row, bumps its counter (publishes), and reads another rank's part once
that rank's counter has reached the collective. A rank waits only for the parts it reads, by
polling a counter while yielding its core, not in a collective that every rank must enter (a
gloo fence per collective, the previous design, cost more than the data movement it guarded).

Once full, the arena is reused from its start: by then every rank has read what it wanted from
it (every collective completes before returning), which the group agrees on in a one-element gloo
all-reduce, a few times per step. Collectives larger than a row go in pieces. The counters are
plain stores and loads, ordered by x86's total store order; on other hosts (and between hosts, or
containers with separate /dev/shm, or without room) the group uses gloo. The tp groups' process
group (shared_memory_process_group.py) runs the same two collectives, and an all-reduce, on an
arena of its own.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

# A group's arena, all rows together, at most.
BUFFER_BYTES = 256 * 2**20
ALIGNMENT = 64
COUNTER_BYTES = 64  # one cache line per rank's counter
DECISION_BYTES = 1024  # rank 0's word on the arena: its path, or why there is none
SUMS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)  # the reductions the arena computes


class SharedMemoryGroup:
    """The arena of one group of ranks, or `rows` None where they cannot share one. `control`
    carries the arena's own few collectives (its creation, and a fence when it is reused): the
    gloo process group or gloo backend of the same ranks, never one whose collectives use this
    arena."""

    def __init__(
        self,
        control: dist.ProcessGroup | dist.ProcessGroupGloo,
        *,
        rank: int,
        ranks: int,
        row_bytes: int,
        timeout_s: float,
        label: str = "FSDP",
    ) -> None:
        self.control = control
        self.ranks = ranks
        self.rank = rank
        self.row_bytes = row_bytes
        self.timeout_s = timeout_s
        self.label = label
        self.offset = 0  # next free byte of every row
        self.collectives = 0  # collectives taken so far; the counters count the same
        self._fence_flag = torch.zeros(1, dtype=torch.int32)
        # Polling keeps a core busy: only while every thread of the job has a core of its own;
        # otherwise a waiting rank sleeps, or it would take the core of the rank it waits for.
        threads = dist.get_world_size() * torch.get_num_threads()
        self.poll = threads <= len(os.sched_getaffinity(0))
        self.rows, self.counters = self._map_arena()

    def take(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """The next `nbytes` of every row (ranks, nbytes) and the collective's number."""
        assert nbytes <= self.row_bytes
        if self.offset + nbytes > self.row_bytes:
            # Every rank has read what it wanted from the arena once every rank gets here.
            _control_all_reduce(self.control, self._fence_flag, dist.ReduceOp.SUM)
            self.offset = 0
        start = self.offset
        self.offset += -(-nbytes // ALIGNMENT) * ALIGNMENT
        self.collectives += 1
        return self.rows[:, start : start + nbytes], self.collectives

    def publish(self, collective: int) -> None:
        self.counters[self.rank] = collective

    def wait_for(self, collective: int, ranks: Sequence[int]) -> None:
        """Return once every rank in `ranks` has published `collective`."""
        deadline = None
        for rank in ranks:
            counter = self.counters[rank]
            polls, nap = 0, 2e-5
            while counter.item() < collective:
                polls += 1
                if self.poll and polls < 2000:
                    time.sleep(0)  # yields the core, if anything else wants it
                    continue
                deadline = deadline or time.monotonic() + self.timeout_s
                if time.monotonic() > deadline:
                    raise dist.DistError(
                        f"shared-memory collective timed out: rank {rank} of the {self.label} "
                        f"group did not arrive within {self.timeout_s:.0f} s "
                        "(resilience.collective_timeout_s)"
                    )
                time.sleep(nap)
                nap = min(2 * nap, 5e-5 if self.poll else 1e-3)

    def _map_arena(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        header = self.ranks * COUNTER_BYTES
        size = header + self.ranks * self.row_bytes
        # Rank 0 decides where the arena lives (or why it cannot) and tells the group.
        decision = torch.zeros(DECISION_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            encoded = _create_buffer_file(size).encode()[:DECISION_BYTES]
            decision[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        _control_broadcast(self.control, decision)
        path = bytes(decision.tolist()).rstrip(b"\0").decode(errors="replace")
        if path.startswith("error: "):
            if self.rank == 0:
                print(
                    f"kiln: WARNING: the {self.label} group's collectives stay on gloo (slower on "
                    f"CPU): no room for their shared-memory buffer, {path[7:]}. Give /dev/shm "
                    "more room (docker run --shm-size=1g), or set "
                    "distributed.shared_memory_collectives = false",
                    file=sys.stderr,
                    flush=True,
                )
            return None, None
        # Only a rank that sees rank 0's file may map it: mapping a missing path creates a
        # private file, which would silently share nothing.
        seen = torch.tensor([1 if os.path.exists(path) else 0], dtype=torch.int32)
        mapped = None
        if seen.item():
            mapped = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        _control_all_reduce(self.control, seen, dist.ReduceOp.MIN)
        if self.rank == 0:
            os.unlink(path)  # the mappings keep the memory; nothing is left behind on exit
        if not seen.item():
            return None, None
        counters = mapped[:header].view(torch.int64).view(self.ranks, COUNTER_BYTES // 8)[:, 0]
        return mapped[header:].view(self.ranks, self.row_bytes), counters


def _control_all_reduce(control, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
    options = dist.AllreduceOptions()
    options.reduceOp = op
    control.allreduce([tensor], options).wait()


def _control_broadcast(control, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    control.broadcast([tensor], options).wait()


def _create_buffer_file(nbytes: int) -> str:
    """A zeroed file of `nbytes` whose memory is reserved now (so a full /dev/shm fails here,
    not with SIGBUS later), as its path, or 'error: <why>'."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    descriptor, path = tempfile.mkstemp(prefix="kiln-fsdp-", dir=directory)
    try:
        os.posix_fallocate(descriptor, 0, nbytes)
    except OSError as error:
        os.unlink(path)
        return f"error: {nbytes / 2**20:.0f} MiB in {directory}: {error.strerror}"
    finally:
        os.close(descriptor)
    return path


class SharedMemoryBuffers:
    """The arenas of the groups the collectives have used, one per group, created at the group's
    first collective: rows of `largest_bytes` (what one rank writes for the largest collective;
    larger ones go in pieces), or of what BUFFER_BYTES allows for the group if that is less."""

    def __init__(self, largest_bytes: int, *, timeout_s: float = 600.0) -> None:
        self.largest_bytes = largest_bytes
        self.timeout_s = timeout_s
        self._groups: dict[dist.ProcessGroup, SharedMemoryGroup] = {}

    def of(self, group: dist.ProcessGroup) -> SharedMemoryGroup | None:
        if group not in self._groups:
            most = BUFFER_BYTES // group.size()
            # At least one 8-byte element per rank in a reduce-scatter's piece.
            least = ALIGNMENT * group.size()
            row_bytes = -(-max(least, min(self.largest_bytes, most)) // ALIGNMENT) * ALIGNMENT
            self._groups[group] = SharedMemoryGroup(
                group,
                rank=group.rank(),
                ranks=group.size(),
                row_bytes=row_bytes,
                timeout_s=self.timeout_s,
            )
        found = self._groups[group]
        return found if found.rows is not None else None


class SharedMemoryComm:
    """Base of the two collectives; both use the same arenas."""

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
        all_gather(shared, output_tensor, input_tensor)
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
        if shared is None or op not in SUMS:
            return dist.reduce_scatter_single(output_tensor, input_tensor, op, group, async_op)
        reduce_scatter(shared, output_tensor, input_tensor, op)
        return None


def all_gather(shared: SharedMemoryGroup, output: torch.Tensor, input: torch.Tensor) -> None:
    """`output` (contiguous, ranks × input's elements): every rank's `input`, in rank order."""
    sent = input.reshape(-1).view(torch.uint8)
    gathered = output.view(torch.uint8).view(shared.ranks, sent.numel())
    me = shared.rank
    if sent.data_ptr() != gathered[me].data_ptr():  # FSDP copies its shard in beforehand
        gathered[me].copy_(sent)
    others = [rank for rank in range(shared.ranks) if rank != me]
    for start in range(0, sent.numel(), shared.row_bytes):
        end = min(start + shared.row_bytes, sent.numel())
        rows, collective = shared.take(end - start)
        rows[me].copy_(sent[start:end])
        shared.publish(collective)
        shared.wait_for(collective, others)
        for rank in others:
            gathered[rank, start:end].copy_(rows[rank])


def reduce_scatter(
    shared: SharedMemoryGroup, output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp
) -> None:
    """`output`: this rank's chunk of the sum (`op` SUM) or mean (AVG) of every rank's `input`
    (contiguous, ranks chunks), summed in rank order."""
    ranks, size, me = shared.ranks, output.numel(), shared.rank
    chunks = input.view(ranks, size)  # chunk r is rank r's share
    itemsize = input.element_size()
    piece = shared.row_bytes // (ranks * itemsize)
    flat = output.view(-1)
    for start in range(0, size, piece):
        end = min(start + piece, size)
        rows, collective = shared.take(ranks * (end - start) * itemsize)
        # Rank r's row holds its chunks for every rank; its own it reads in place.
        slots = rows.view(input.dtype).view(ranks, ranks, end - start)
        mine = chunks[:, start:end]
        slots[me, :me].copy_(mine[:me])
        slots[me, me + 1 :].copy_(mine[me + 1 :])
        shared.publish(collective)
        shared.wait_for(collective, [rank for rank in range(ranks) if rank != me])
        received = [mine[me] if rank == me else slots[rank, me] for rank in range(ranks)]
        _sum_in_rank_order(received, out=flat[start:end])
    if op == dist.ReduceOp.AVG:
        output.div_(ranks)


def all_reduce(shared: SharedMemoryGroup, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
    """`tensor` (contiguous), in place: the sum (`op` SUM) or mean (AVG) of every rank's, summed
    in rank order, so bitwise the same on every rank."""
    flat, itemsize = tensor.view(-1), tensor.element_size()
    piece = shared.row_bytes // itemsize
    others = [rank for rank in range(shared.ranks) if rank != shared.rank]
    for start in range(0, flat.numel(), piece):
        end = min(start + piece, flat.numel())
        rows, collective = shared.take((end - start) * itemsize)
        slots = rows.view(tensor.dtype)
        slots[shared.rank].copy_(flat[start:end])
        shared.publish(collective)
        shared.wait_for(collective, others)
        _sum_in_rank_order(list(slots), out=flat[start:end])
    if op == dist.ReduceOp.AVG:
        tensor.div_(shared.ranks)


def _sum_in_rank_order(parts: list[torch.Tensor], *, out: torch.Tensor) -> None:
    # The same order on every rank, whatever the layout.
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)


def supported() -> bool:
    """Whether this host's memory ordering makes the arena's counters safe (x86's is)."""
    return platform.machine().lower() in ("x86_64", "amd64") and hasattr(os, "posix_fallocate")


def use_shared_memory_collectives(
    parts: list[nn.Module], buffers: SharedMemoryBuffers | None = None, *, timeout_s: float = 600.0
) -> None:
    """Route the all-gathers and reduce-scatters of every FSDP unit in `parts` through shared
    memory (CPU only; call after the last `fully_shard`), on hosts where `supported()`.
    `buffers` None: rows as large as the model's fp32 parameters, if the cap allows (a small
    model's arena costs little to create). `timeout_s`: how long a rank waits for a peer."""
    if not supported():
        return
    if buffers is None:
        model_bytes = 4 * sum(p.numel() for part in parts for p in part.parameters())
        buffers = SharedMemoryBuffers(largest_bytes=model_bytes, timeout_s=timeout_s)
    gather, reduce = SharedMemoryAllGather(buffers), SharedMemoryReduceScatter(buffers)
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(gather)
                module.set_custom_reduce_scatter(reduce)
