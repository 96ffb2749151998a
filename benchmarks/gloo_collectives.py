"""What FSDP's collectives cost on gloo: two ranks of one thread each on this machine's cores,
buffers the size of FSDP units of the 29M model in fsdp_overhead.py (1 to 34 MB unsharded).

Times, per call (mean of 10 after one warm-up), gloo's `all_gather_into_tensor`,
`reduce_scatter_tensor` and `all_reduce` of the whole buffer, and a reduce-scatter built from
`all_to_all_single` plus a local sum of the received slices, and kiln's shared-memory all-gather
and reduce-scatter (tests/support/shared_memory_collectives.py, the test suite's), checked
equal to gloo's:

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        benchmarks/gloo_collectives.py
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tests.support.shared_memory_collectives import (
    SharedMemoryAllGather,
    SharedMemoryBuffers,
    SharedMemoryReduceScatter,
)

SIZES_MB = (1, 8, 34)
CALLS = 10


def timed(op) -> float:
    op()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(CALLS):
        op()
    return (time.perf_counter() - start) / CALLS * 1e3


def row(megabytes: int, ranks: int, buffers: SharedMemoryBuffers) -> list[float]:
    """Milliseconds per call of the six ways, for an unsharded buffer of `megabytes`."""
    numel = megabytes * 2**20 // 4 // ranks * ranks
    full, received = torch.randn(numel), torch.empty(numel)
    shard = torch.randn(numel // ranks)
    world = dist.group.WORLD
    shared_gather, shared_reduce = (
        SharedMemoryAllGather(buffers),
        SharedMemoryReduceScatter(buffers),
    )
    gathered, reduced = torch.empty(numel), torch.empty(numel // ranks)
    dist.all_gather_into_tensor(gathered, shard)
    shared_gather(full, shard, world)
    assert torch.equal(full, gathered), "shared-memory all-gather differs from gloo's"
    dist.reduce_scatter_single(reduced, full)
    shared_reduce(shard, full, world, dist.ReduceOp.SUM)
    assert torch.equal(shard, reduced), "shared-memory reduce-scatter differs from gloo's"

    def all_to_all_sum() -> None:
        dist.all_to_all_single(received, full)
        torch.sum(received.view(ranks, -1), dim=0, out=shard)

    return [
        timed(lambda: dist.all_gather_into_tensor(full, shard)),
        timed(lambda: dist.reduce_scatter_single(shard, full)),
        timed(lambda: dist.all_reduce(full)),
        timed(all_to_all_sum),
        timed(lambda: shared_gather(full, shard, world)),
        timed(lambda: shared_reduce(shard, full, world, dist.ReduceOp.SUM)),
    ]


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ranks = dist.get_world_size()
    if dist.get_rank() == 0:
        print(
            "| unsharded buffer | all-gather | reduce-scatter | all-reduce | all-to-all + sum "
            "| shared-memory all-gather | shared-memory reduce-scatter |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
    buffers = SharedMemoryBuffers(largest_bytes=max(SIZES_MB) * 2**20)
    for megabytes in SIZES_MB:
        ms = row(megabytes, ranks, buffers)
        if dist.get_rank() == 0:
            print(f"| {megabytes} MB | " + " | ".join(f"{m:.1f} ms" for m in ms) + " |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
