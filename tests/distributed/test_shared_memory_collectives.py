"""FSDP's shared-memory all-gather and reduce-scatter (kiln/parallel/shared_memory_collectives.py).

On 4 ranks, in the world group and in two groups of 2 at once: the all-gather equals gloo's, the
reduce-scatter equals the sum (or average) in rank order that each rank computes locally from
the other ranks' seeded inputs, the all-gather into a separate output and in place, for fp32 and
bf16, with arenas small enough that every collective goes in several pieces, ends on a ragged
one and reuses the arena many times. Then FSDP itself, on 2 ranks, three steps of AdamW with two
micro-batches each, reducing after each micro-batch and once per step: the gradients of every
step and the final weights are bitwise those of gloo with the shared-memory collectives, with an
arena so small that it is reused within every backward, and for a model whose arena cannot be
reserved (it falls back to gloo, with one warning). Nothing is left in /dev/shm.
"""

import glob

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from kiln.parallel import shared_memory_collectives as shm


def test_collectives_match_gloo_in_pieces_and_groups(gangs):
    gangs.run(4, check_collectives)


def test_fsdp_gradients_are_bitwise_those_of_gloo(gangs):
    outputs = gangs.run(2, check_fsdp_gradients)
    # Two models' buffers cannot be reserved: rank 0 says so once each, both ranks use gloo.
    warnings = [output.count("collectives stay on gloo") for output in outputs]
    assert warnings == [2, 0], outputs


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
                    gather(got, shard, group)
                    dist.all_gather_into_tensor(expected, shard, group)
                    assert torch.equal(got, expected), (dtype, numel)
                    # As FSDP calls it: the shard already in its row of the output.
                    in_place = torch.zeros_like(got)
                    in_place.view(ranks, numel)[me] = shard
                    gather(in_place, in_place.view(ranks, numel)[me], group)
                    assert torch.equal(in_place, expected), (dtype, numel, "in place")
                    inputs = [seeded(r, ranks * numel, dtype).view(ranks, numel) for r in members]
                    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                        out = torch.empty(numel, dtype=dtype)
                        reduce(out, inputs[me].reshape(-1), group, op)
                        want = inputs[0][me].clone()
                        for other in inputs[1:]:
                            want += other[me]
                        if op == dist.ReduceOp.AVG:
                            want /= ranks
                        assert torch.equal(out, want), (dtype, numel, op)
        assert all(buffers.of(group) is not None for group in groups.values())
        assert len(buffers._groups) == 2  # the world and this rank's pair, for both collectives
        dist.barrier()
        assert not glob.glob("/dev/shm/kiln-fsdp-*"), "a shared-memory buffer file was left"
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
    buffers = None
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
    return grads, [p.detach().to_local().clone() for p in model.parameters()]
