"""FSDP's all-gather and reduce-scatter through shared memory, for CPU ranks on one host.

On CPU, gloo moves every byte of FSDP's traffic through TCP loopback, on the same cores that
compute, and every collective is a point where each rank waits for the slowest
(benchmarks/fsdp_overhead.md). Here the ranks of a group map one arena in /dev/shm instead: one
row per rank, and beside each row a counter of the collectives whose data that rank has written.
A collective takes the next bytes of every row (the same bytes on every rank: each rank sees the
same collective sizes in the same order, FSDP pads shards to equal sizes); a rank copies its part
into its row and bumps its counter (publishes), and reads another rank's part once that rank's
counter has reached the collective. No rank waits for a peer that has not yet asked for data
it provides: a rank waits only for the data it reads, and only when it reads it.

That is what lets a rank run ahead of its peer. With `overlap`, FSDP issues each all-gather one
unit early (explicit forward prefetch, backward prefetch, async unshard): the rank publishes its
shard then and reads the others' when the unit runs. And a reduce-scatter run inside backward
only publishes; its output is filled at the end of that backward (an autograd final callback),
after every reduce-scatter of the backward has been published. That is only correct while FSDP
does not read the output before then: it is deferred only for units whose reduction FSDP hands
over as the gradient itself (no divide factor, no replicate all-reduce, no dtype cast, no hook),
with gradients set to None before the step and reduced once per step, as kiln's trainer does.

The arena is reused from its start once full: every rank completes its pending reads, then the
group passes a one-element gloo all-reduce (a fence). Collectives larger than a row go in pieces.
The counters are plain stores and loads, ordered by x86's total store order; elsewhere (and
between hosts or containers with separate /dev/shm, or without room) the group uses gloo.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

# A group's arena, all rows together, at most.
BUFFER_BYTES = 256 * 2**20
ALIGNMENT = 64
COUNTER_BYTES = 64  # one cache line per rank's counter


class SharedMemoryGroup:
    """The arena of one process group, or `rows` None where its ranks cannot share one."""

    def __init__(self, group: dist.ProcessGroup, row_bytes: int, timeout_s: float) -> None:
        self.group = group
        self.ranks = group.size()
        self.rank = group.rank()
        self.row_bytes = row_bytes
        self.timeout_s = timeout_s
        self.offset = 0  # next free byte of every row
        self.collectives = 0  # collectives taken so far; the counters count the same
        self.pending: list[Callable[[], None]] = []  # reads to complete before the arena is reused
        self._fence_flag = torch.zeros(1, dtype=torch.int32)
        self.rows, self.counters = self._map_arena()

    def take(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """The next `nbytes` of every row (ranks, nbytes) and the collective's number."""
        assert nbytes <= self.row_bytes
        if self.offset + nbytes > self.row_bytes:
            self.reuse()
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
            spins = 0
            while counter.item() < collective:
                spins += 1
                if spins < 2000:
                    time.sleep(0)  # yield: a waiting rank must not take a core its peer needs
                    continue
                deadline = deadline or time.monotonic() + self.timeout_s
                if time.monotonic() > deadline:
                    raise dist.DistError(
                        f"shared-memory collective timed out: rank {rank} of the FSDP group did "
                        f"not arrive within {self.timeout_s:.0f} s"
                    )
                time.sleep(5e-5)

    def complete_pending(self) -> None:
        pending, self.pending = self.pending, []
        for read in pending:
            read()

    def reuse(self) -> None:
        """Start the arena over: once every rank has read everything it wanted from it."""
        self.complete_pending()
        dist.all_reduce(self._fence_flag, group=self.group)
        self.offset = 0

    def _map_arena(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        header = self.ranks * COUNTER_BYTES
        size = header + self.ranks * self.row_bytes
        # Rank 0 decides where the arena lives (or why it cannot) and tells the group.
        decision: list[str | None] = [None]
        if self.rank == 0:
            decision[0] = _create_arena_file(size)
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
            return None, None
        # Only a rank that sees rank 0's file may map it: mapping a missing path creates a
        # private file, which would silently share nothing.
        seen = torch.tensor([1 if os.path.exists(path) else 0], dtype=torch.int32)
        mapped = None
        if seen.item():
            mapped = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        dist.all_reduce(seen, op=dist.ReduceOp.MIN, group=self.group)
        if self.rank == 0:
            os.unlink(path)  # the mappings keep the memory; nothing is left behind on exit
        if not seen.item():
            return None, None
        counters = mapped[:header].view(torch.int64).view(self.ranks, COUNTER_BYTES // 8)[:, 0]
        return mapped[header:].view(self.ranks, self.row_bytes), counters


def _create_arena_file(nbytes: int) -> str:
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
        self._flush_queued = False
        self.deferred = 0  # reductions filled at the end of a backward, so far

    def of(self, group: dist.ProcessGroup) -> SharedMemoryGroup | None:
        if group not in self._groups:
            most = BUFFER_BYTES // group.size()
            # At least one 8-byte element per rank in a reduce-scatter's piece.
            least = ALIGNMENT * group.size()
            row_bytes = -(-max(least, min(self.largest_bytes, most)) // ALIGNMENT) * ALIGNMENT
            self._groups[group] = SharedMemoryGroup(group, row_bytes, self.timeout_s)
        found = self._groups[group]
        return found if found.rows is not None else None

    def defer_to_end_of_backward(self, shared: SharedMemoryGroup, read: Callable[[], None]) -> bool:
        """Queue `read` to run when the running backward ends; False outside a backward."""
        if torch._C._current_graph_task_id() == -1:
            return False
        if not self._flush_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
            self._flush_queued = True
        shared.pending.append(read)
        self.deferred += 1
        return True

    def _flush(self) -> None:
        self._flush_queued = False
        for shared in self._groups.values():
            shared.complete_pending()


class _PendingRead(dist.Work):
    """An all-gather whose other ranks' parts are read when FSDP waits for it."""

    def __init__(self, shared: SharedMemoryGroup, read: Callable[[], None]) -> None:
        super().__init__()
        self._shared = shared
        self._read: Callable[[], None] | None = read
        shared.pending.append(self.wait)

    def wait(self, timeout: object = None) -> bool:
        if self._read is not None:
            read, self._read = self._read, None
            read()
            # Read early or now: either way the arena no longer needs it, nor it the output.
            if self.wait in self._shared.pending:
                self._shared.pending.remove(self.wait)
        return True


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
        sent = input_tensor.reshape(-1).view(torch.uint8)
        gathered = output_tensor.view(torch.uint8).view(shared.ranks, sent.numel())
        me = shared.rank
        if sent.data_ptr() != gathered[me].data_ptr():  # FSDP copies its shard in beforehand
            gathered[me].copy_(sent)
        pieces = range(0, sent.numel(), shared.row_bytes)
        if async_op and len(pieces) == 1:
            rows, collective = shared.take(sent.numel())
            rows[me].copy_(sent)
            shared.publish(collective)
            return _PendingRead(shared, lambda: _read_rows(shared, collective, rows, gathered))
        for start in pieces:
            end = min(start + shared.row_bytes, sent.numel())
            rows, collective = shared.take(end - start)
            rows[me].copy_(sent[start:end])
            shared.publish(collective)
            _read_rows(shared, collective, rows, gathered[:, start:end])
        return None


def _read_rows(
    shared: SharedMemoryGroup, collective: int, rows: torch.Tensor, gathered: torch.Tensor
) -> None:
    others = [rank for rank in range(shared.ranks) if rank != shared.rank]
    shared.wait_for(collective, others)
    for rank in others:
        gathered[rank].copy_(rows[rank])


class SharedMemoryReduceScatter(SharedMemoryComm, ReduceScatter):
    """`unit`: the FSDP unit whose reductions may be filled at the end of backward (see the
    module), checked at every call; None: every reduction is filled before the call returns."""

    def __init__(self, buffers: SharedMemoryBuffers, unit: FSDPModule | None = None) -> None:
        super().__init__(buffers)
        self.unit = unit

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
        ranks, size = shared.ranks, output_tensor.numel()
        chunks = input_tensor.view(ranks, size)  # chunk r is rank r's share
        itemsize = input_tensor.element_size()
        piece = shared.row_bytes // (ranks * itemsize)
        pieces = range(0, size, piece)
        for start in pieces:
            end = min(start + piece, size)
            rows, collective = shared.take(ranks * (end - start) * itemsize)
            slots = rows.view(input_tensor.dtype).view(ranks, ranks, end - start)
            slots[shared.rank].copy_(chunks[:, start:end])
            shared.publish(collective)

            def read(start=start, end=end, slots=slots, collective=collective) -> None:
                _sum_rows(shared, collective, slots, output_tensor[start:end], op)

            deferred = len(pieces) == 1 and self._output_is_the_new_gradient()
            if not (deferred and self.buffers.defer_to_end_of_backward(shared, read)):
                read()
        return None

    def _output_is_the_new_gradient(self) -> bool:
        # With no gradient yet, FSDP makes the output the gradient, unread; with one, it adds
        # the output to it at once (gradient accumulation with a reduction per micro-batch).
        if self.unit is None:
            return False
        group = self.unit._get_fsdp_state()._fsdp_param_group
        return all(param.sharded_param.grad is None for param in group.fsdp_params)


def _sum_rows(
    shared: SharedMemoryGroup,
    collective: int,
    slots: torch.Tensor,
    out: torch.Tensor,
    op: dist.ReduceOp,
) -> None:
    ranks, me = shared.ranks, shared.rank
    shared.wait_for(collective, [rank for rank in range(ranks) if rank != me])
    # Summed in rank order: the same order on every rank, whatever the layout.
    received = [slots[rank, me] for rank in range(ranks)]
    if ranks == 1:
        out.copy_(received[0])
    else:
        torch.add(received[0], received[1], out=out)
    for row in received[2:]:
        out.add_(row)
    if op == dist.ReduceOp.AVG:
        out.div_(ranks)


def supported() -> bool:
    """Whether this host's memory ordering makes the arena's counters safe (x86's is)."""
    return platform.machine().lower() in ("x86_64", "amd64") and hasattr(os, "posix_fallocate")


def use_shared_memory_collectives(
    parts: list[nn.Module],
    buffers: SharedMemoryBuffers | None = None,
    *,
    overlap: bool = True,
    timeout_s: float = 600.0,
) -> SharedMemoryBuffers | None:
    """Route the all-gathers and reduce-scatters of every FSDP unit in `parts` through shared
    memory (CPU only; call after the last `fully_shard`). `buffers` None: rows as large as the
    model's fp32 parameters, if the cap allows. `overlap`: prefetch each unit's all-gather one
    unit early and defer reduce-scatters to the end of backward, where FSDP allows it. Returns
    the buffers, or None where this host cannot use them (FSDP stays on gloo)."""
    if not supported():
        return None
    if buffers is None:
        model_bytes = 4 * sum(p.numel() for part in parts for p in part.parameters())
        buffers = SharedMemoryBuffers(largest_bytes=2 * model_bytes, timeout_s=timeout_s)
    gather = SharedMemoryAllGather(buffers)
    for part in parts:
        units = [module for module in part.modules() if isinstance(module, FSDPModule)]
        for index, unit in enumerate(units):
            unit.set_custom_all_gather(gather)
            deferrable = overlap and _reduction_is_the_gradient(unit)
            unit.set_custom_reduce_scatter(
                SharedMemoryReduceScatter(buffers, unit if deferrable else None)
            )
            if overlap:
                unit._set_unshard_async_op(True)
                if index + 1 < len(units):
                    unit.set_modules_to_forward_prefetch([units[index + 1]])
    return buffers


def _reduction_is_the_gradient(unit: FSDPModule) -> bool:
    """Whether FSDP hands the reduce-scatter's output over as the gradient, unread, when there is
    no gradient yet: no divide factor after it, no all-reduce over replicas, no cast to another
    dtype, no hook."""
    group = unit._get_fsdp_state()._fsdp_param_group
    if group is None:
        return False
    policy = group.mp_policy
    return (
        group.gradient_divide_factor is None
        and not group.force_sum_reduction_for_comms
        and not isinstance(group.mesh_info, DDPMeshInfo)
        and group._all_reduce_hook is None
        and all(
            policy.reduce_dtype in (None, param.sharded_param.dtype) for param in group.fsdp_params
        )
    )
