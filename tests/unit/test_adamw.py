"""ShardLocalAdamW is torch.optim.AdamW bit for bit: the update (decay and no-decay groups, lrs
changed every step, a weight without a gradient), the state and its state dict, both ways; on
DTensors in one process too. Layouts of several ranks: tests/distributed/test_parity.py."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

from kiln.config.sections import OptimizerConfig
from kiln.train.adamw import ShardLocalAdamW
from kiln.train.optimizer import build_optimizer

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1
SHAPES = [(8, 5), (4, 6), (5,), (3,)]


def _params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _groups(params):
    # The first matrix is decayed, the rest not; each group gets its own lr below.
    return [
        {"params": params[:2], "weight_decay": WD},
        {"params": params[2:], "weight_decay": 0.0},
    ]


def _torch_adamw(params, fused=False):
    flags = dict(fused=True) if fused else dict(foreach=True)  # what kiln built before
    return torch.optim.AdamW(_groups(params), lr=LR, betas=BETAS, eps=EPS, **flags)


def _local_adamw(params, fused=False):
    return ShardLocalAdamW(_groups(params), lr=LR, betas=BETAS, eps=EPS, fused=fused)


def _run(optimizer, params, steps, start=0):
    """kiln's loop: every group's lr set each step (here a different one per group); the last
    weight has no gradient at the first two steps (torch skips it: no state, no decay)."""
    for step in range(start, start + steps):
        for i, group in enumerate(optimizer.param_groups):
            group["lr"] = LR * (1 + step) / (1 + i)
        generator = torch.Generator().manual_seed(100 + step)
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=generator)
            p.grad = None if i == len(params) - 1 and step < 2 else grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _assert_same(a_params, a_opt, b_params, b_opt):
    for a, b in zip(a_params, b_params, strict=True):
        assert torch.equal(a, b)
        a_state, b_state = a_opt.state[a], b_opt.state[b]
        assert a_state.keys() == b_state.keys()
        for key in a_state:
            assert type(a_state[key]) is type(b_state[key]), key
            assert a_state[key].dtype == b_state[key].dtype, key
            assert a_state[key].device == b_state[key].device, key
            assert torch.equal(a_state[key], b_state[key]), key


# Fused: the CUDA path's code, run by torch's fused CPU kernel.
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_matches_torch_adamw_step_for_step_exactly(fused):
    ours, theirs = _params(), _params()
    local_opt, torch_opt = _local_adamw(ours, fused), _torch_adamw(theirs, fused)
    _run(local_opt, ours, 1)
    assert ours[-1] not in local_opt.state  # no gradient yet: skipped, as torch does
    _run(local_opt, ours, 4, start=1)
    _run(torch_opt, theirs, 5)
    assert not torch.equal(ours[0], _params()[0])  # it moved
    _assert_same(ours, local_opt, theirs, torch_opt)
    assert local_opt.state_dict()["param_groups"] == torch_opt.state_dict()["param_groups"]


@pytest.mark.parametrize("saved_by", ["torch", "shard_local"])
def test_state_dict_loads_either_way_and_resumes_bitwise(saved_by):
    first, second = (_torch_adamw, _local_adamw)[:: 1 if saved_by == "torch" else -1]
    params = _params()
    saver = first(params)
    _run(saver, params, 3)
    resumed_params = [nn.Parameter(p.detach().clone()) for p in params]
    resumed = second(resumed_params)
    # A copy, as a checkpoint holds: load_state_dict keeps the very tensors it is given.
    resumed.load_state_dict(copy.deepcopy(saver.state_dict()))
    _run(saver, params, 3, start=3)
    _run(resumed, resumed_params, 3, start=3)
    _assert_same(params, saver, resumed_params, resumed)


def test_build_optimizer_uses_it_for_adamw():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    (adamw,) = build_optimizer(model, OptimizerConfig(name="adamw"))
    assert type(adamw) is ShardLocalAdamW
    assert adamw.param_groups[0]["foreach"] is True  # on CPU: foreach, not one tensor at a time


@pytest.fixture
def one_rank_mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_on_dtensors_state_stays_dtensors_and_matches_torch(one_rank_mesh):
    def sharded():
        return [
            nn.Parameter(distribute_tensor(p.detach(), one_rank_mesh, [Shard(0)]))
            for p in _params()
        ]

    ours, theirs = sharded(), sharded()
    local_opt, torch_opt = _local_adamw(ours), _torch_adamw(theirs)
    for optimizer, params in ((local_opt, ours), (torch_opt, theirs)):
        for step in range(3):
            generator = torch.Generator().manual_seed(100 + step)
            for p in params:
                grad = torch.randn(p.shape, generator=generator)
                p.grad = distribute_tensor(grad, one_rank_mesh, [Shard(0)])
            optimizer.step()
    for p in ours:
        for key in ("exp_avg", "exp_avg_sq"):
            state = local_opt.state[p][key]
            assert isinstance(state, DTensor) and state.placements == p.placements
        assert not isinstance(local_opt.state[p]["step"], DTensor)
    _assert_same(ours, local_opt, theirs, torch_opt)
