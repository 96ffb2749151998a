"""FSDP's shared-memory all-gather and reduce-scatter (tests/support/shared_memory_collectives.py),
the test suite's accelerator.

On 4 ranks, in the world group and in two groups of 2 at once: the all-gather equals gloo's, the
reduce-scatter equals the sum (or average) in rank order that each rank computes locally from
the other ranks' seeded inputs, the all-gather into a separate output and in place, for fp32 and
bf16, with arenas small enough that every collective goes in several pieces, ends on a ragged
one and reuses the arena many times. Then FSDP itself, on 2 ranks, three steps of AdamW with two
micro-batches each, reducing after each micro-batch and once per step: the gradients of every
step and the final weights are bitwise those of gloo with the shared-memory collectives, with an
arena so small that it is reused within every backward, and for a model whose arena cannot be
reserved (it falls back to gloo, with one warning). Every collective that should go through
the arena is seen to (its count of collectives and bytes grows), so a silent fall-back to gloo
fails. Nothing is left in /dev/shm.

The arena's failures: a start that fails on one rank (no file on rank 0, a rank that cannot map
it) leaves every rank on gloo, agreed, with no file left; a peer that never arrives leaves no
file; ranks that disagree on a collective's size get an error, not bytes nobody sent.
"""

import datetime
import glob
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.support import shared_memory_collectives as shm


def test_collectives_match_gloo_in_pieces_and_groups(gangs):
    gangs.run(4, check_collectives)


def test_fsdp_gradients_are_bitwise_those_of_gloo(gangs):
    outputs = gangs.run(2, check_fsdp_gradients)
    # Two models' buffers cannot be reserved: rank 0 says so once each, both ranks use gloo.
    warnings = [output.count("collectives stay on gloo") for output in outputs]
    assert warnings == [2, 0], outputs


@pytest.mark.parametrize("failure", ["no file on rank 0", "rank 1 cannot map it"])
def test_a_failed_start_leaves_every_rank_on_gloo_and_no_file(gangs, failure):
    outputs = gangs.run(2, check_failed_start, failure)
    assert [output.count("collectives stay on gloo") for output in outputs] == [1, 0], outputs


def test_a_peer_that_never_arrives_leaves_no_file(gangs):
    gangs.run(2, check_absent_peer)


def test_ranks_that_disagree_on_a_size_get_an_error(gangs):
    gangs.run(2, check_size_disagreement)


def own_files() -> list[str]:
    """The arena files this process created and left (other test sessions may have theirs)."""
    return glob.glob(f"/dev/shm/{shm.FILE_PREFIX}{os.getpid()}-*")


def seeded(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=generator).to(dtype)


def check_collectives() -> None:
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        groups = {"world": dist.group.WORLD, "pair": pairs[rank // 2]}
        buffers = shm.SharedMemoryBuffers(largest_bytes=512)  # many pieces
        gather = shm.SharedMemoryAllGather(buffers)
        reduce = shm.SharedMemoryReduceScatter(buffers)
        for group in groups.values():
            members = dist.get_process_group_ranks(group)
            ranks, me = len(members), group.rank()
            for dtype in (torch.float32, torch.bfloat16):
                for numel in (7, 301, 1000):
                    shard = seeded(rank, numel, dtype)
                    got = torch.empty(ranks * numel, dtype=dtype)
                    expected = torch.empty_like(got)
                    through_arena(buffers.of(group), gather, got, shard, group)
                    dist.all_gather_into_tensor(expected, shard, group)
                    assert torch.equal(got, expected), (dtype, numel)
                    # As FSDP calls it: the shard already in its row of the output.
                    in_place = torch.zeros_like(got)
                    in_place.view(ranks, numel)[me] = shard
                    mine = in_place.view(ranks, numel)[me]
                    through_arena(buffers.of(group), gather, in_place, mine, group)
                    assert torch.equal(in_place, expected), (dtype, numel, "in place")
                    inputs = [seeded(r, ranks * numel, dtype).view(ranks, numel) for r in members]
                    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                        out = torch.empty(numel, dtype=dtype)
                        arena = buffers.of(group)
                        through_arena(arena, reduce, out, inputs[me].reshape(-1), group, op)
                        want = inputs[0][me].clone()
                        for other in inputs[1:]:
                            want += other[me]
                        if op == dist.ReduceOp.AVG:
                            want /= ranks
                        assert torch.equal(out, want), (dtype, numel, op)
        assert all(buffers.of(group) is not None for group in groups.values())
        assert len(buffers._groups) == 2  # the world and this rank's pair, for both collectives
        dist.barrier()
        assert not own_files(), "a shared-memory buffer file was left"
    finally:
        dist.destroy_process_group()


def through_arena(arena: shm.SharedMemoryGroup | None, collective, *args) -> None:
    """`collective(*args)`, which must move its bytes through `arena` (not gloo)."""
    assert arena is not None, "no arena"
    before = arena.collectives, arena.bytes_moved
    collective(*args)
    assert arena.collectives > before[0] and arena.bytes_moved > before[1], "not through the arena"


def check_failed_start(failure: str) -> None:
    """One rank's start fails: every rank learns it and keeps gloo; the collectives stay right."""
    dist.init_process_group("gloo")
    rank, saved = dist.get_rank(), (tempfile.mkstemp, torch.from_file)
    try:
        if failure == "no file on rank 0" and rank == 0:
            tempfile.mkstemp = _raise(OSError(28, "No space left on device"))
        if failure == "rank 1 cannot map it" and rank == 1:
            torch.from_file = _raise(RuntimeError("unable to mmap"))
        buffers = shm.SharedMemoryBuffers(largest_bytes=4096, timeout_s=30)
        assert buffers.of(dist.group.WORLD) is None  # on every rank: they agreed
        shard = seeded(rank, 300, torch.float32)
        got, expected = torch.empty(600), torch.empty(600)
        shm.SharedMemoryAllGather(buffers)(got, shard, dist.group.WORLD)  # gloo's
        dist.all_gather_into_tensor(expected, shard)
        assert torch.equal(got, expected)
        dist.barrier()
        assert not own_files(), "a shared-memory buffer file was left"
    finally:
        tempfile.mkstemp, torch.from_file = saved
        dist.destroy_process_group()


def _raise(error: Exception):
    def fail(*args, **kwargs):
        raise error

    return fail


def check_absent_peer() -> None:
    """Rank 1 never joins the arena's creation: rank 0 gives up at the group's timeout, and the
    file it created is gone."""
    dist.init_process_group("gloo")
    try:
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
        if dist.get_rank() == 0:
            with pytest.raises(Exception):  # noqa: B017 (gloo's timeout error, whatever its type)
                shm.SharedMemoryGroup(group, rank=0, ranks=2, row_bytes=4096, timeout_s=3)
            assert not own_files(), "a shared-memory buffer file was left"
        dist.barrier()  # on the world group: rank 1 waits here until rank 0 is done
    finally:
        dist.destroy_process_group()


def check_size_disagreement() -> None:
    """Rank 0 gathers 100 elements, rank 1 200: both are told, neither reads the other's row."""
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        buffers = shm.SharedMemoryBuffers(largest_bytes=4096, timeout_s=20)
        numel = 100 * (rank + 1)
        got = torch.full((2 * numel,), float("nan"))
        with pytest.raises(dist.DistError, match="the ranks disagree on the size"):
            shm.SharedMemoryAllGather(buffers)(got, torch.ones(numel), dist.group.WORLD)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def check_fsdp_gradients() -> None:
    dist.init_process_group("gloo")
    default_bytes = shm.BUFFER_BYTES
    try:
        mesh = init_device_mesh("cpu", (2,))
        for per_step in (False, True):
            runs = {
                way: train_three_steps(mesh, way, reduce_per_step=per_step)
                for way in ("gloo", "shared memory", "small arena", "no room")
            }
            for way, (grads, weights) in runs.items():
                assert all(map(torch.equal, grads, runs["gloo"][0])), (way, per_step)
                assert all(map(torch.equal, weights, runs["gloo"][1])), (way, per_step)
    finally:
        shm.BUFFER_BYTES = default_bytes  # the gang's processes run later jobs
        dist.destroy_process_group()


def train_three_steps(mesh, way: str, *, reduce_per_step: bool):
    """Every step's gradients and the final weights of a small FSDP model trained `way`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(33, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 5))
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    buffers = shm.SharedMemoryBuffers(largest_bytes=4 * sum(p.numel() for p in model.parameters()))
    if way == "small arena":  # rows of 1 KiB: reused many times in every backward
        buffers = shm.SharedMemoryBuffers(largest_bytes=1024)
    elif way == "no room":  # a 1 EiB buffer: no file system reserves it
        shm.BUFFER_BYTES = 2**60
        buffers = shm.SharedMemoryBuffers(2**60)
    if way != "gloo":
        shm.use_shared_memory_collectives([model], buffers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(dist.get_rank())
    grads = []
    for _ in range(3):
        for micro_batch in range(2):
            if reduce_per_step:
                model.set_requires_gradient_sync(micro_batch == 1)
            inputs = torch.randn(8, 33, generator=generator)
            model(inputs).square().mean().backward()
        grads += [p.grad.to_local().clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    arena = buffers.of(mesh.get_group()) if way != "gloo" else None
    moved = arena.bytes_moved if arena is not None else 0
    assert (moved > 0) == (way in ("shared memory", "small arena")), (way, moved)
    return grads, [p.detach().to_local().clone() for p in model.parameters()]
