"""A gang job (workers.py): the expert-parallel dispatcher against the local one, on every rank.

Each rank routes its own tokens (some ranks send nothing to some others: empty splits), the
"experts" scale their rows by a factor per global expert, and the combined output and the
input's gradient must equal, bit for bit, what the local dispatcher gives on the same tokens
with all experts in one place; identity experts with one-hot weights give back the input."""

import torch
import torch.distributed as dist

from kiln.model.moe.dispatch import LocalDispatcher
from kiln.parallel.all_to_all_stats import AllToAllStats
from kiln.parallel.expert_dispatch import AllToAllDispatcher

EXPERTS, TOP_K, DIM = 8, 2, 16


def scale_by_expert(rows, per_expert, first_expert):
    factors = torch.arange(first_expert, first_expert + len(per_expert), dtype=rows.dtype) + 1
    return rows * torch.repeat_interleave(factors, per_expert, output_size=len(rows))[:, None]


def run_local(x, indices, weights, capacity):
    local = LocalDispatcher(EXPERTS, TOP_K, capacity)
    rows, per_expert, state = local.dispatch(x, indices)
    return local.combine(scale_by_expert(rows, per_expert, 0), weights, state)


def check_dispatch(*capacities: float) -> None:
    dist.init_process_group("gloo")
    for capacity in capacities:
        _check(capacity)
    dist.destroy_process_group()


def _check(capacity: float) -> None:
    rank, ranks = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    tokens = 5 + 3 * rank
    indices = torch.stack(
        [torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)]
    )
    if rank == 0:  # nothing for the last rank's experts: an empty split
        indices = indices % (EXPERTS - EXPERTS // ranks)
        indices[:, 1] = (indices[:, 0] + 1) % (EXPERTS - EXPERTS // ranks)
    weights = torch.rand(tokens, TOP_K, generator=generator)
    x = torch.randn(tokens, DIM, generator=generator)
    upstream = torch.randn(tokens, DIM, generator=generator)

    stats = AllToAllStats(torch.device("cpu"))
    dispatcher = AllToAllDispatcher(EXPERTS, TOP_K, capacity, group=dist.group.WORLD, stats=stats)
    x_ep = x.clone().requires_grad_()
    rows, per_expert, state = dispatcher.dispatch(x_ep, indices)
    assert per_expert.shape == (EXPERTS // ranks,) and int(per_expert.sum()) == len(rows)
    out = dispatcher.combine(
        scale_by_expert(rows, per_expert, rank * EXPERTS // ranks), weights, state
    )
    (out * upstream).sum().backward()

    x_local = x.clone().requires_grad_()
    expected = run_local(x_local, indices, weights, capacity)
    (expected * upstream).sum().backward()
    assert torch.equal(out, expected), (out - expected).abs().max()
    assert torch.equal(x_ep.grad, x_local.grad)

    one_hot = torch.zeros(tokens, TOP_K)
    one_hot[:, 0] = 1
    x_round = x.clone().requires_grad_()
    rows, per_expert, state = dispatcher.dispatch(x_round, indices)
    back = dispatcher.combine(rows, one_hot, state)
    back.backward(upstream)
    if capacity == 0:
        assert torch.equal(back, x) and torch.equal(x_round.grad, upstream)
