"""The tensor-parallel groups' process group on CPU (tests/support/shared_memory_process_group.py),
the test suite's accelerator.

On 4 ranks, in the world group and in two groups of 2 at once, with rows so small that every
collective goes in several pieces and reuses the arena: DTensor's functional all-reduce (sum
and average), all-gather and reduce-scatter, and torch.distributed's all-reduce, equal the sum or
mean in rank order that each rank computes from the others' seeded inputs, for fp32 and bf16;
what the arena does not compute (a max, a broadcast) is gloo's and right too. Then tensor and
sequence parallelism itself, on 2 ranks: three AdamW steps of a block with a sequence-parallel
norm, a column- and a row-parallel linear, whose gradients every step and final weights are
bitwise those on a gloo group, also with tiny rows, and with an arena that cannot be reserved
(gloo, with one warning). Each collective the arena computes is seen to go through it (its
count of collectives and bytes grows; what gloo computes leaves them alone), so a group that
quietly used gloo for everything fails. Nothing is left in /dev/shm.
"""

import contextlib
import datetime

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tests.distributed.test_shared_memory_collectives import own_files, seeded
from tests.distributed.workers import clear_dtensor_caches
from tests.support import shared_memory_process_group as shm_group


def test_collectives_are_the_rank_order_sums_in_pieces_and_groups(gangs):
    gangs.run(4, check_collectives)


def test_tensor_parallel_training_is_bitwise_that_of_gloo(gangs):
    outputs = gangs.run(2, check_training)
    # The arena that cannot be reserved: rank 0 says so once, both ranks use gloo.
    warnings = [output.count("collectives stay on gloo") for output in outputs]
    assert warnings == [1, 0], outputs


def in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def check_collectives() -> None:
    dist.init_process_group("gloo")
    row_bytes = shm_group.ROW_BYTES
    shm_group.ROW_BYTES = 512  # many pieces, the arena reused many times
    try:
        assert shm_group.register()
        rank = dist.get_rank()
        # A rank left waiting fails the job in a minute, not the default half hour.
        timeout = datetime.timedelta(seconds=60)
        world = dist.new_group(backend=shm_group.BACKEND, timeout=timeout)
        pairs = [
            dist.new_group(members, backend=shm_group.BACKEND, timeout=timeout)
            for members in ([0, 1], [2, 3])
        ]
        for group in (world, pairs[rank // 2]):
            assert isinstance(group, shm_group.SharedMemoryProcessGroup)
            assert group.arena.rows is not None
            check_group(group)
        dist.barrier()
        assert not own_files(), "a shared-memory buffer file was left"
    finally:
        shm_group.ROW_BYTES = row_bytes  # the gang's processes run later jobs
        dist.destroy_process_group()


def check_group(group: dist.ProcessGroup) -> None:
    members = dist.get_process_group_ranks(group)
    ranks, me = len(members), group.rank()
    arena = Moved(group.arena)
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (7, 301, 1000):
            case = (dtype, numel, ranks)
            inputs = [seeded(r, numel, dtype) for r in members]
            total = in_rank_order(inputs)
            with arena.through(case):
                got = funcol.all_reduce(inputs[me], "sum", group).wait()
            assert torch.equal(got, total), case
            with arena.through(case):
                mean = funcol.all_reduce(inputs[me], "avg", group).wait()
            assert torch.equal(mean, total / ranks), case
            summed = inputs[me].clone()
            with arena.through(case):
                dist.all_reduce(summed, group=group)
            assert torch.equal(summed, total), case
            largest = inputs[me].clone()
            with arena.through(case, expected=False):  # gloo's
                dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
            assert torch.equal(largest, torch.stack(inputs).amax(0)), case

            with arena.through(case):
                gathered = funcol.all_gather_tensor(inputs[me], 0, group).wait()
            assert torch.equal(gathered, torch.cat(inputs)), case

            full = [seeded(100 + r, ranks * numel, dtype).view(ranks, numel) for r in members]
            with arena.through(case):
                scattered = funcol.reduce_scatter_tensor(full[me].reshape(-1), "sum", 0, group)
                scattered = scattered.wait()
            assert torch.equal(scattered, in_rank_order([f[me] for f in full])), case

            sent = inputs[0].clone() if me == 0 else torch.zeros(numel, dtype=dtype)
            with arena.through(case, expected=False):  # gloo's
                dist.broadcast(sent, group_src=0, group=group)
            assert torch.equal(sent, inputs[0]), case


class Moved:
    """Whether a collective went through the arena: its counts of collectives and bytes grow."""

    def __init__(self, arena) -> None:
        self.arena = arena

    @contextlib.contextmanager
    def through(self, case, *, expected: bool = True):
        before = self.arena.collectives, self.arena.bytes_moved
        yield
        after = self.arena.collectives, self.arena.bytes_moved
        moved = after[0] > before[0] and after[1] > before[1]
        assert moved == expected, (case, "through the arena" if moved else "not through it")


def check_training() -> None:
    dist.init_process_group("gloo")
    row_bytes = shm_group.ROW_BYTES
    try:
        assert shm_group.register()
        runs = {}
        for way, rows in (
            ("gloo", row_bytes),
            ("shared memory", row_bytes),
            ("small rows", 1024),  # reused several times in every step
            ("no room", 2**60),  # no file system reserves it: gloo
        ):
            shm_group.ROW_BYTES = rows
            # DTensor caches its plans by mesh, and meshes of the same shape compare equal:
            # without this, every way ran on the first way's group (gloo), the arena unused.
            clear_dtensor_caches()
            backend = "gloo" if way == "gloo" else shm_group.BACKEND
            mesh = init_device_mesh(
                "cpu", (2,), mesh_dim_names=("tp",), backend_override={"tp": backend}
            )
            shared = isinstance(mesh.get_group(), shm_group.SharedMemoryProcessGroup)
            assert shared == (way != "gloo"), way
            runs[way] = train_three_steps(mesh)
            arena = mesh.get_group().arena if shared else None
            moved = arena.bytes_moved if arena is not None and arena.rows is not None else 0
            assert (moved > 0) == (way in ("shared memory", "small rows")), (way, moved)
        for way, (grads, weights) in runs.items():
            assert all(map(torch.equal, grads, runs["gloo"][0])), way
            assert all(map(torch.equal, weights, runs["gloo"][1])), way
    finally:
        shm_group.ROW_BYTES = row_bytes
        dist.destroy_process_group()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 96)
        self.down = nn.Linear(96, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


def train_three_steps(mesh):
    """Every step's gradients and the final weights of a tensor- and sequence-parallel block:
    the norm's gradients all-reduced, the activations all-gathered into the column-parallel
    linear and reduce-scattered out of the row-parallel one (and the reverse in backward)."""
    torch.manual_seed(0)
    plan = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }
    model = parallelize_module(Block(), mesh, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(3):
        sequence = torch.randn(4, 16, 32, generator=generator)
        local = sequence.chunk(2, dim=1)[dist.get_rank()]  # this rank's half of the sequence
        model(local).square().mean().backward()
        grads += [p.grad.to_local().clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return grads, [p.detach().to_local().clone() for p in model.parameters()]
