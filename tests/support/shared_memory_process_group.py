"""A CPU process group whose all-reduces, all-gathers and reduce-scatters go through shared memory:
what DTensor issues for tensor and sequence parallelism, a few dozen times a step. A test-suite
accelerator: the gang workers give it to the tp groups of their jobs (accelerator.py); kiln's
own CPU runs use gloo.

gloo moves each of them through TCP loopback, on the cores that compute; a tensor-parallel step
on CPU spent a third of its time waiting on them (benchmarks/test_suite.md). This group keeps a
gloo backend for everything else (broadcasts, object collectives, all-to-alls, point-to-point,
other reductions), so it is a drop-in for the group of a mesh dimension: DTensor's functional
collectives find it by the group's name and call the three methods below, as they call
ProcessGroupGloo's. The arena is that of FSDP's CPU path (shared_memory_collectives.py), with an
all-reduce beside its all-gather and reduce-scatter; a group whose ranks do not share a host (or
whose arena finds no room) finds out when it is created, on rank 0's word, and keeps gloo.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    ReduceScatterOptions,
    _create_work_from_future,
)
from torch.futures import Future

from tests.support.shared_memory_collectives import (
    SUMS,
    SharedMemoryGroup,
    all_gather,
    all_reduce,
    reduce_scatter,
    supported,
)

BACKEND = "tests_shm"
# A rank's row. Activations larger than a row (tp's are a micro-batch's hidden states) go in
# pieces; a few of them fill the arena before it is reused.
ROW_BYTES = 8 * 2**20


@dataclass
class SharedMemoryOptions:
    """What a device mesh passes to each group it creates on this backend (`backend_override`):
    the group's timeout, under the name torch's mesh reads. A rank waiting for a peer in the
    arena gives up after it too."""

    _timeout: datetime.timedelta


class SharedMemoryProcessGroup(dist.ProcessGroup):
    """Created by `torch.distributed.new_group(backend=BACKEND)` (or a device mesh's
    `backend_override`) once `register()` has run."""

    def __init__(
        self,
        options: dist.distributed_c10d._DistributedBackendOptions,
        _config: SharedMemoryOptions | None,
    ) -> None:
        super().__init__(options.group_rank, options.group_size)
        self.gloo = dist.ProcessGroupGloo(
            options.store, options.group_rank, options.group_size, options.timeout
        )
        # What torch dispatches in C++ rather than through the methods below (an all-gather into
        # one tensor called from Python, gather, scatter, reduce) goes to this gloo backend.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.gloo)
        self.arena = SharedMemoryGroup(
            self.gloo,
            rank=options.group_rank,
            ranks=options.group_size,
            row_bytes=ROW_BYTES,
            timeout_s=options.timeout.total_seconds(),
            label="tensor-parallel",
        )

    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> dist.Work:
        op = opts.reduceOp.op  # a RedOpType, comparable with SUMS (the ReduceOp object is not)
        if not self._shares(tensors) or op not in SUMS:
            return self.gloo.allreduce(tensors, opts)
        for tensor in tensors:
            all_reduce(self.arena, tensor, op)
        return _done(tensors)

    def all_gather_single_coalesced(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: AllgatherOptions,
    ) -> dist.Work:
        for output, input in zip(outputs, inputs, strict=True):
            if self._shares([output, input]):
                all_gather(self.arena, output, input)
            else:
                self.gloo._allgather_base(output, input, opts).wait()
        return _done(outputs)

    def reduce_scatter_single_coalesced(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: ReduceScatterOptions,
    ) -> dist.Work:
        op = opts.reduceOp.op
        for output, input in zip(outputs, inputs, strict=True):
            if self._shares([output, input]) and op in SUMS:
                reduce_scatter(self.arena, output, input, op)
            else:
                self.gloo._reduce_scatter_base(output, input, opts).wait()
        return _done(outputs)

    # Every other collective the C++ side may call on this group, handed to gloo from Python.
    # Left to torch's default, it would reach gloo with the GIL held, and deadlock whenever gloo's
    # worker thread, holding its queue's lock, frees a tensor that needs the GIL.

    def allgather(self, outputs, inputs, opts) -> dist.Work:
        return self.gloo.allgather(outputs, inputs, opts)

    def allreduce_coalesced(self, tensors, opts) -> dist.Work:
        return self.gloo.allreduce_coalesced(tensors, opts)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts) -> dist.Work:
        return self.gloo.alltoall_base(output, input, output_splits, input_splits, opts)

    def barrier(self, opts) -> dist.Work:
        return self.gloo.barrier(opts)

    def broadcast(self, tensors, opts) -> dist.Work:
        return self.gloo.broadcast(tensors, opts)

    def reduce_scatter(self, outputs, inputs, opts) -> dist.Work:
        return self.gloo.reduce_scatter(outputs, inputs, opts)

    def send(self, tensors, dst, tag) -> dist.Work:
        return self.gloo.send(tensors, dst, tag)

    def recv(self, tensors, src, tag) -> dist.Work:
        return self.gloo.recv(tensors, src, tag)

    def _shares(self, tensors: list[torch.Tensor]) -> bool:
        """Whether the arena can carry a collective of `tensors`."""
        return self.arena.rows is not None and all(
            t.device.type == "cpu" and t.is_contiguous() for t in tensors
        )


def _done(result: list[torch.Tensor]) -> dist.Work:
    """A finished collective's Work: the arena's collectives complete before they return."""
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


def register() -> bool:
    """Make BACKEND available to `new_group` and device meshes in this process; False where the
    arena's memory ordering is not guaranteed (see `supported`), and the caller keeps gloo."""
    if not supported():
        return False
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            BACKEND, SharedMemoryProcessGroup, extended_api=True, devices=["cpu"]
        )
    return True
