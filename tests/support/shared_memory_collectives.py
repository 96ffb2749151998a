"""FSDP's all-gather and reduce-scatter through shared memory, for CPU ranks on one host: the
test suite's accelerator, installed by the gang workers (accelerator.py), never by kiln, whose
CPU runs use gloo.

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
containers with separate /dev/shm, or without room, or where any rank fails to map the arena:
the ranks agree on it) the group uses gloo. Beside its counter, each rank publishes the size of
its collective, so ranks that disagree on a shard's size get an error, not bytes nobody sent.
The tp groups' process group (shared_memory_process_group.py) runs the same two collectives, and
an all-reduce, on an arena of its own.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

# A group's arena, all rows together, at most.
BUFFER_BYTES = 256 * 2**20
ALIGNMENT = 64
COUNTER_BYTES = 64  # one cache line per rank: its counter, then two collectives' sizes
DECISION_BYTES = 1024  # rank 0's word on the arena: its path, or why there is none
SUMS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)  # the reductions the arena computes
FILE_PREFIX = "kiln-fsdp-"  # then the creating process's id: a test finds its own files
# How often a waiting rank looks again at the machine's load to choose between polling and
# sleeping.
LOAD_CHECK_S = 0.1


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
        self.bytes_moved = 0  # what this rank wrote into its row: the tests check it is used
        self._fence_flag = torch.zeros(1, dtype=torch.int32)
        self._sizes = (0, 0)  # the current collective's (piece, whole) bytes, as published
        self.load = MachineLoad(job_threads=dist.get_world_size() * torch.get_num_threads())
        self.rows, self.header = self._map_arena()
        self.counters = self.header[:, 0] if self.header is not None else None

    def take(self, nbytes: int, whole: int) -> tuple[torch.Tensor, int]:
        """The next `nbytes` of every row (ranks, nbytes) and the collective's number, for a
        piece of `nbytes` of a collective of `whole` bytes per rank."""
        assert nbytes <= self.row_bytes
        if self.offset + nbytes > self.row_bytes:
            # Every rank has read what it wanted from the arena once every rank gets here.
            _control_all_reduce(self.control, self._fence_flag, dist.ReduceOp.SUM)
            self.offset = 0
        start = self.offset
        self.offset += -(-nbytes // ALIGNMENT) * ALIGNMENT
        self.collectives += 1
        self.bytes_moved += nbytes
        self._sizes = (nbytes, whole)
        return self.rows[:, start : start + nbytes], self.collectives

    def publish(self, collective: int) -> None:
        """Sizes first, then the counter: x86 keeps the stores in order, so a peer that sees the
        counter sees the sizes."""
        slot = _size_slot(collective)
        self.header[self.rank, slot], self.header[self.rank, slot + 1] = self._sizes
        self.counters[self.rank] = collective

    def wait_for(self, collective: int, ranks: Sequence[int]) -> None:
        """Return once every rank in `ranks` has published `collective` with this rank's sizes."""
        for rank in ranks:
            self._wait_for_rank(collective, rank)
            self._check_sizes(collective, rank)

    def _check_sizes(self, collective: int, rank: int) -> None:
        # A peer is at most one collective ahead (it waits for this rank's next one), so the
        # slot of `collective` still holds that peer's sizes for it.
        slot = _size_slot(collective)
        theirs = tuple(int(v) for v in self.header[rank, slot : slot + 2].tolist())
        if theirs != self._sizes:
            raise dist.DistError(
                f"shared-memory collective {collective} of the {self.label} group: rank {rank} "
                f"sends {theirs[0]} bytes of {theirs[1]}, this rank (rank {self.rank}) "
                f"{self._sizes[0]} of {self._sizes[1]}: the ranks disagree on the size"
            )

    def _wait_for_rank(self, collective: int, rank: int) -> None:
        deadline = None
        counter = self.counters[rank]
        polls, nap = 0, 2e-5
        while counter.item() < collective:
            polls += 1
            if polls < 2000 and self.load.may_poll():
                time.sleep(0)  # yields the core, if anything else wants it
                continue
            deadline = deadline or time.monotonic() + self.timeout_s
            if time.monotonic() > deadline:
                raise dist.DistError(
                    f"shared-memory collective timed out: rank {rank} of the {self.label} "
                    f"group did not arrive within {self.timeout_s:.0f} s"
                )
            time.sleep(nap)
            nap = min(2 * nap, 5e-5 if self.load.may_poll() else 1e-3)

    def _map_arena(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(rows, header) of the arena every rank mapped, or (None, None) on every rank when
        rank 0 could not create it or any rank could not map it: the group keeps gloo."""
        header = self.ranks * COUNTER_BYTES
        size = header + self.ranks * self.row_bytes
        created = _create_buffer_file(size) if self.rank == 0 else ""
        try:
            path = self._agree_on_path(created)
            mapped = None if path.startswith("error: ") else _map_file(path, size)
            # Every rank must have mapped it, or none uses it.
            everyone = torch.tensor([mapped is not None], dtype=torch.int32)
            _control_all_reduce(self.control, everyone, dist.ReduceOp.MIN)
        finally:
            # The mappings keep the memory; the file goes even when a peer never arrives.
            if not created.startswith("error: ") and self.rank == 0:
                os.unlink(created)
        if not everyone.item():
            self._warn_gloo(path[7:] if path.startswith("error: ") else "a rank could not map it")
            return None, None
        words = mapped[:header].view(torch.int64).view(self.ranks, COUNTER_BYTES // 8)
        return mapped[header:].view(self.ranks, self.row_bytes), words

    def _agree_on_path(self, created: str) -> str:
        """Rank 0's word on where the arena lives, or 'error: <why>' there is none."""
        decision = torch.zeros(DECISION_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            encoded = created.encode()[:DECISION_BYTES]
            decision[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        _control_broadcast(self.control, decision)
        return bytes(decision.tolist()).rstrip(b"\0").decode(errors="replace")

    def _warn_gloo(self, why: str) -> None:
        if self.rank == 0:
            print(
                f"tests: WARNING: the {self.label} group's collectives stay on gloo: no "
                f"shared-memory arena, {why}. Give /dev/shm more room "
                "(docker run --shm-size=1g)",
                file=sys.stderr,
                flush=True,
            )


def _size_slot(collective: int) -> int:
    # Words 1-2 and 3-4 of a rank's header line, by the collective's parity.
    return 1 + 2 * (collective % 2)


def _map_file(path: str, size: int) -> torch.Tensor | None:
    """`path` mapped shared, or None where it cannot be: mapping a missing path would create a
    private file that silently shares nothing."""
    if not os.path.exists(path):
        return None
    try:
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None


class MachineLoad:
    """Whether a waiting rank may poll. Polling keeps a core busy, so only while every thread
    that wants to run, this job's and every other process's on the machine, has a core; otherwise
    a waiting rank sleeps, or it takes the core of the rank it waits for, or another job's.
    Looked at again every LOAD_CHECK_S: another job may start or end."""

    def __init__(
        self,
        job_threads: int,
        *,
        cores: int | None = None,
        read_loadavg: Callable[[], str] | None = None,
    ) -> None:
        self.job_threads = job_threads
        self.cores = cores or len(os.sched_getaffinity(0))
        self.read_loadavg = read_loadavg or _read_loadavg
        self._checked, self._poll = -float("inf"), False

    def may_poll(self) -> bool:
        now = time.monotonic()
        if now - self._checked > LOAD_CHECK_S:
            self._checked, self._poll = now, self._decide()
        return self._poll

    def _decide(self) -> bool:
        runnable = runnable_threads(self.read_loadavg())
        return max(self.job_threads, runnable or 0) <= self.cores


def runnable_threads(loadavg: str) -> int | None:
    """The machine's runnable threads now (the fourth field of /proc/loadavg, "running/total",
    counts every process's, the reader included), or None where unknown."""
    try:
        return int(loadavg.split()[3].split("/")[0])
    except (IndexError, ValueError):
        return None


def _read_loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text()
    except OSError:
        return ""


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
    not with SIGBUS later), as its path, or 'error: <why>' (then no file is left)."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    try:
        descriptor, path = tempfile.mkstemp(prefix=f"{FILE_PREFIX}{os.getpid()}-", dir=directory)
    except OSError as error:
        return f"error: no file in {directory}: {error.strerror}"
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
        rows, collective = shared.take(end - start, sent.numel())
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
        rows, collective = shared.take(ranks * (end - start) * itemsize, input.numel() * itemsize)
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
        rows, collective = shared.take((end - start) * itemsize, flat.numel() * itemsize)
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
