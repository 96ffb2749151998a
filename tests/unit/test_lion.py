"""Lion: the update of the paper, weight decay on matrices only, its state through a state dict."""

import copy

import pytest
import torch
from torch import nn

from kiln.config.sections import OptimizerConfig
from kiln.train.lion import Lion
from kiln.train.optimizer import build_optimizer

LR, BETAS, WD = 1e-3, (0.9, 0.99), 0.5


def _params(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        nn.Parameter(torch.randn(8, 5, generator=generator)),
        nn.Parameter(torch.randn(5, generator=generator)),
    ]


def _grads(step, shapes):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _reference(weights, steps, lrs):
    """Chen et al. 2023, Algorithm 2, one tensor at a time; decay on the matrix only."""
    weights = [w.detach().clone() for w in weights]
    momenta = [torch.zeros_like(w) for w in weights]
    for step in range(steps):
        lr = lrs[step]
        for w, m, g, wd in zip(
            weights, momenta, _grads(step, [w.shape for w in weights]), (WD, 0), strict=True
        ):
            update = torch.sign(m * BETAS[0] + g * (1 - BETAS[0]))
            w.mul_(1 - lr * wd).add_(update, alpha=-lr)
            m.mul_(BETAS[1]).add_(g, alpha=1 - BETAS[1])
    return weights, momenta


def _run(optimizer, params, steps, lrs, start=0):
    for step in range(start, start + steps):
        for group in optimizer.param_groups:
            group["lr"] = lrs[step]
        for p, g in zip(params, _grads(step, [p.shape for p in params]), strict=True):
            p.grad = g
        optimizer.step()
        optimizer.zero_grad()


def _lion(params):
    groups = [{"params": [params[0]], "weight_decay": WD}, {"params": [params[1]]}]
    return Lion(groups, lr=LR, betas=BETAS)


def test_lion_matches_the_paper_step_for_step_exactly():
    params = _params()
    lrs = [LR * f for f in (0.25, 0.5, 1.0, 1.0, 1.0)]  # a warmup, as the scheduler sets it
    expected, momenta = _reference(params, 5, lrs)
    optimizer = _lion(params)
    _run(optimizer, params, 5, lrs)
    for p, e, m in zip(params, expected, momenta, strict=True):
        assert torch.equal(p.detach(), e)
        assert torch.equal(optimizer.state[p]["exp_avg"], m)


def test_every_weight_moves_by_lr_per_step_without_decay():
    params = _params()
    before = [p.detach().clone() for p in params]
    optimizer = Lion(params, lr=LR, betas=BETAS)
    _run(optimizer, params, 1, [LR])
    for p, b in zip(params, before, strict=True):
        torch.testing.assert_close((p.detach() - b).abs(), torch.full_like(b, LR))


def test_the_state_dict_round_trip_continues_identically():
    lrs = [LR] * 6
    params_a = _params()
    a = _lion(params_a)
    _run(a, params_a, 3, lrs)
    params_b = [nn.Parameter(p.detach().clone()) for p in params_a]
    reloaded = _lion(params_b)
    reloaded.load_state_dict(copy.deepcopy(a.state_dict()))
    _run(a, params_a, 3, lrs, start=3)
    _run(reloaded, params_b, 3, lrs, start=3)
    for p, q in zip(params_a, params_b, strict=True):
        assert torch.equal(p, q)


def test_build_optimizer_decays_matrices_only():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    cfg = OptimizerConfig(name="lion", lr=1e-4, weight_decay=1.0, betas=[0.9, 0.99])
    (optimizer,) = build_optimizer(model, cfg)
    assert isinstance(optimizer, Lion)
    decay = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert decay[id(model[0].weight)] == 1.0
    assert decay[id(model[0].bias)] == decay[id(model[1].weight)] == 0.0
    assert all(g["base_lr"] == 1e-4 and g["betas"] == (0.9, 0.99) for g in optimizer.param_groups)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="Lion"):
        Lion(_params(), lr=LR, betas=(0.9, 1.0))
