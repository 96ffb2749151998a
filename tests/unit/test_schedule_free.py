"""Schedule-Free AdamW: the paper's equations, the switch between the training point y and the
evaluation point x, its scalars through state dicts and checkpoints, and a `kiln train` run that
saves at x and resumes bitwise."""

import copy
import json

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from kiln.checkpoint import load_checkpoint
from kiln.checkpoint.checkpointer import save_checkpoint
from kiln.checkpoint.state import FLAT
from kiln.cli import main as kiln_main
from kiln.config import JobConfig, validate
from kiln.config.sections import OptimizerConfig
from kiln.errors import ConfigError
from kiln.train.optimizer import build_optimizer
from kiln.train.schedule_free import (
    ScheduleFreeAdamW,
    optimizer_eval_point,
    optimizer_train_point,
)
from tests.conftest import DEBUG_CONFIG
from tests.unit.test_trainer import make_trainer

BETAS, EPS, WD = (0.9, 0.99), 1e-8, 0.1
LRS = [0.01 * f for f in (0.25, 0.5, 0.75, 1, 1, 1, 1, 1, 1, 1)]  # warmup, then constant
SF = ("--optimizer.name=schedule_free_adamw", "--scheduler.name=constant")


def _problem(seed=0):
    """A noisy quadratic 0.5·Σ a·(w − w*)² over a matrix and a vector."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(6, 4), (4,)]
    start = [torch.randn(s, generator=generator) for s in shapes]
    curvature = [torch.rand(s, generator=generator) + 0.5 for s in shapes]
    optimum = [torch.randn(s, generator=generator) for s in shapes]
    return start, curvature, optimum


def _gradient(step, weights, curvature, optimum):
    generator = torch.Generator().manual_seed(1000 + step)
    return [
        a * (w - o) + 0.1 * torch.randn(w.shape, generator=generator)
        for w, a, o in zip(weights, curvature, optimum, strict=True)
    ]


def _loss(weights, curvature, optimum):
    return sum(
        (0.5 * a * (w - o) ** 2).sum() for w, a, o in zip(weights, curvature, optimum, strict=True)
    )


def _reference(steps, lrs, problem):
    """Algorithm 1 of Defazio et al. 2024 as written: x and z kept, y computed, the gradient
    taken at y, decay on the matrix only. Returns (x, y, z)."""
    start, curvature, optimum = problem
    xs = [w.clone() for w in start]
    zs = [w.clone() for w in start]
    vs = [torch.zeros_like(w) for w in start]
    beta1, beta2 = BETAS
    lr_sq_sum = 0.0
    for t in range(1, steps + 1):
        ys = [(1 - beta1) * z + beta1 * x for x, z in zip(xs, zs, strict=True)]
        grads = _gradient(t, ys, curvature, optimum)
        gamma = lrs[t - 1] * (1 - beta2**t) ** 0.5
        lr_sq_sum += gamma**2
        c = gamma**2 / lr_sq_sum
        for i, (y, g, wd) in enumerate(zip(ys, grads, (WD, 0.0), strict=True)):
            vs[i] = beta2 * vs[i] + (1 - beta2) * g**2
            zs[i] = zs[i] - gamma * g / (vs[i].sqrt() + EPS) - gamma * wd * y
            xs[i] = (1 - c) * xs[i] + c * zs[i]
    ys = [(1 - beta1) * z + beta1 * x for x, z in zip(xs, zs, strict=True)]
    return xs, ys, zs


def _optimizer(params, lr=LRS[0]):
    groups = [{"params": [params[0]], "weight_decay": WD}, {"params": [params[1]]}]
    return ScheduleFreeAdamW(groups, lr=lr, betas=BETAS, eps=EPS)


def _train(optimizer, params, problem, steps, lrs, start=0):
    _, curvature, optimum = problem
    for t in range(start + 1, start + steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lrs[t - 1]
        for p, g in zip(
            params, _gradient(t, [p.detach() for p in params], curvature, optimum), strict=True
        ):
            p.grad = g
        optimizer.step()
        optimizer.zero_grad()


def _started(steps=5):
    problem = _problem()
    params = [nn.Parameter(w.clone()) for w in problem[0]]
    optimizer = _optimizer(params)
    _train(optimizer, params, problem, steps, LRS)
    return problem, params, optimizer


def test_schedule_free_follows_the_paper_within_1e_6():
    problem = _problem()
    xs, ys, zs = _reference(10, LRS, problem)
    params = [nn.Parameter(w.clone()) for w in problem[0]]
    optimizer = _optimizer(params)
    _train(optimizer, params, problem, 10, LRS)
    for p, y, z in zip(params, ys, zs, strict=True):
        torch.testing.assert_close(p.detach(), y, rtol=0, atol=1e-6)
        torch.testing.assert_close(optimizer.state[p]["z"], z, rtol=0, atol=1e-6)
    assert optimizer.eval_mode()
    for p, x in zip(params, xs, strict=True):
        torch.testing.assert_close(p.detach(), x, rtol=0, atol=1e-6)


def test_the_switch_to_x_and_back_round_trips_and_is_idempotent():
    _, params, optimizer = _started()
    y = [p.detach().clone() for p in params]
    assert not optimizer.evaluating
    assert optimizer.eval_mode() and optimizer.evaluating
    x = [p.detach().clone() for p in params]
    assert not optimizer.eval_mode()  # already there: nothing moves
    assert all(torch.equal(p, e) for p, e in zip(params, x, strict=True))
    assert optimizer.train_mode() and not optimizer.train_mode()
    for p, e in zip(params, y, strict=True):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=1e-7)
    assert any(not torch.equal(a, b) for a, b in zip(x, y, strict=True))


def test_a_step_at_the_evaluation_point_is_refused():
    _, params, optimizer = _started(1)
    optimizer.eval_mode()
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="call train_mode"):
        optimizer.step()


def test_weights_that_never_stepped_have_nothing_to_switch():
    params = [nn.Parameter(torch.randn(3, 3))]
    optimizer = ScheduleFreeAdamW(params, lr=0.1)
    assert not optimizer.eval_mode() and not optimizer.state  # no state started by the switch


def test_the_state_dict_saved_at_x_continues_identically():
    """What a checkpoint holds: the weights at x, the state with its scalars and the mode. Loaded
    and switched back to y, training continues bit for bit like the optimizer that saved it."""
    problem, params, optimizer = _started()
    optimizer.eval_mode()
    saved = copy.deepcopy(optimizer.state_dict())
    loaded_params = [nn.Parameter(p.detach().clone()) for p in params]
    optimizer.train_mode()
    loaded = _optimizer(loaded_params)
    loaded.load_state_dict(saved)
    assert loaded.evaluating
    state = loaded.state[loaded_params[0]]
    assert (state["step"], type(state["lr_sq_sum"]), state["eval_mode"]) == (5, float, True)
    loaded.train_mode()
    _train(optimizer, params, problem, 3, LRS, start=5)
    _train(loaded, loaded_params, problem, 3, LRS, start=5)
    for p, q in zip(params, loaded_params, strict=True):
        assert torch.equal(p, q)


def test_the_scalars_survive_a_checkpoint(tmp_path):
    """Through DCP's flattened optimizer state (how kiln checkpoints it): a fresh optimizer,
    whose state DCP first starts with a step at lr 0, takes the saved scalars and mode."""
    model = nn.Linear(4, 3)
    optimizer = ScheduleFreeAdamW(model.parameters(), lr=0.01)
    for _ in range(3):
        model(torch.randn(2, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    flat = get_optimizer_state_dict(model, optimizer, options=FLAT)
    assert {"state.weight.z", "state.weight.step", "state.weight.lr_sq_sum"} <= set(flat)
    with optimizer_eval_point([optimizer]):
        x = model.weight.detach().clone()
        path = save_checkpoint(
            tmp_path, 3, model=model, optimizer=optimizer, config=JobConfig(), train_state={}
        )
    fresh = nn.Linear(4, 3)
    fresh_optimizer = ScheduleFreeAdamW(fresh.parameters(), lr=0.01)
    load_checkpoint(path, model=fresh, optimizer=fresh_optimizer)
    assert torch.equal(fresh.weight, x) and fresh_optimizer.evaluating
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        mine, theirs = optimizer.state[p], fresh_optimizer.state[q]
        assert (theirs["step"], theirs["lr_sq_sum"]) == (mine["step"], mine["lr_sq_sum"]) != (0, 0)
        assert torch.equal(theirs["z"], mine["z"])
    optimizer_train_point([[fresh_optimizer]])
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters(), strict=True)
    )


def test_schedule_free_lowers_the_loss_of_a_quadratic():
    problem = _problem()
    params = [nn.Parameter(w.clone()) for w in problem[0]]
    optimizer = _optimizer(params, lr=0.05)
    _train(optimizer, params, problem, 200, [0.05] * 200)
    optimizer.eval_mode()
    start, curvature, optimum = problem
    assert _loss(params, curvature, optimum) < 0.05 * _loss(start, curvature, optimum)


def test_the_eval_point_context_switches_schedule_free_only_and_nests():
    _, params, optimizer = _started()
    other = nn.Parameter(torch.randn(2))
    adamw = torch.optim.AdamW([other])
    y = [p.detach().clone() for p in params]
    with optimizer_eval_point([[optimizer, adamw]]):
        assert optimizer.evaluating
        with optimizer_eval_point([[optimizer]]):
            pass
        assert optimizer.evaluating  # the inner one switched nothing, so it switches nothing back
    assert not optimizer.evaluating
    with pytest.raises(ZeroDivisionError), optimizer_eval_point([optimizer]):
        raise ZeroDivisionError
    assert not optimizer.evaluating
    for p, e in zip(params, y, strict=True):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=1e-7)


def test_build_optimizer_and_config():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    cfg = OptimizerConfig(name="schedule_free_adamw", lr=1e-3, weight_decay=0.2, eps=1e-6)
    (optimizer,) = build_optimizer(model, cfg)
    assert isinstance(optimizer, ScheduleFreeAdamW)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.2, 0.0]
    assert all(g["eps"] == 1e-6 and g["base_lr"] == 1e-3 for g in optimizer.param_groups)
    job = JobConfig()
    job.optimizer.name, job.optimizer.betas = "schedule_free_adamw", [0.0, 0.99]
    with pytest.raises(ConfigError) as error:
        validate(job)
    assert "betas[0] must be > 0" in str(error.value)
    assert "scheduler.name = 'cosine'" in str(error.value)  # the default decays


def test_the_trainer_saves_and_evaluates_at_x_and_resumes_at_y(debug_overrides, tmp_path):
    trainer = make_trainer(debug_overrides, *SF, "--data.num_workers=0")
    for _ in range(3):
        trainer.train_step()
    (optimizer,) = trainer.optimizers[0]
    seen = []
    trainer.step_fn.evaluate = lambda data: seen.append(_weights(trainer)) or {}
    expected = _eval_point(optimizer, trainer)
    trainer.evaluate()
    assert _equal(seen[0], expected) and not optimizer.evaluating
    expected = _eval_point(optimizer, trainer)
    trainer.save()
    assert not optimizer.evaluating
    y = _weights(trainer)
    saved = tmp_path / "run" / "checkpoints" / "step_00000003"
    model = make_trainer(debug_overrides, *SF, f"--metrics.run_dir={tmp_path / 'other'}")
    load_checkpoint(saved, model=model.model_parts)
    assert _equal(_weights(model), expected)
    resumed = make_trainer(debug_overrides, *SF, "--data.num_workers=0")
    assert resumed.step == 3 and not resumed.optimizers[0][0].evaluating
    assert _equal(_weights(resumed), y)
    assert trainer.train_step().loss.item() == resumed.train_step().loss.item()


def _eval_point(optimizer, trainer):
    """x = y + (1 − 1/β1)·(z − y), computed apart from the optimizer."""
    beta1 = optimizer.param_groups[0]["betas"][0]
    parameters = trainer.model_parts[0].parameters()
    return [p.detach().lerp(optimizer.state[p]["z"], 1 - 1 / beta1) for p in parameters]


def _equal(these, those):
    return len(these) == len(those) and all(
        torch.equal(a, b) for a, b in zip(these, those, strict=True)
    )


def _weights(trainer):
    return [p.detach().clone() for p in trainer.model_parts[0].parameters()]


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_kiln_train_resumes_schedule_free_bitwise(demo_data, tmp_path, mode):
    """Uninterrupted, and stopped at step 3 then resumed: the same losses, evaluations and final
    checkpoint bit for bit (both save at step 3 and evaluate every 2 steps)."""

    def train(run, *extra):
        code = kiln_main(
            [
                "train",
                str(DEBUG_CONFIG),
                *SF,
                "--scheduler.warmup_steps=2",
                f"--data.path={demo_data}",
                "--data.num_workers=0",
                f"--metrics.run_dir={tmp_path / run}",
                "--metrics.log_interval=1",
                "--train.max_steps=6",
                "--checkpoint.interval=3",
                f"--checkpoint.async_mode='{mode}'",
                "--eval.interval=2",
                "--eval.steps=1",
                f"--eval.path={demo_data}",
                *extra,
            ]
        )
        assert code == 0

    train("whole")
    train("parts", "--train.stop_at_step=3")
    train("parts")
    whole, parts = _records(tmp_path / "whole"), _records(tmp_path / "parts")
    assert [r["step"] for r in parts] == list(range(1, 7))
    assert any("eval/loss" in r for r in whole)
    keys = ("loss", "grad_norm", "lr", "eval/loss")
    assert [[r.get(k) for k in keys] for r in parts] == [[r.get(k) for k in keys] for r in whole]
    final = [
        _checkpoint(tmp_path / run / "checkpoints" / "step_00000006") for run in ("whole", "parts")
    ]
    assert final[0].keys() == final[1].keys()
    for key, value in final[0].items():
        other = final[1][key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key


def _records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    by_step = {}
    for record in map(json.loads, lines):  # a resumed run may repeat none; keep the last
        by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def _checkpoint(path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent.parent / f"{path.name}.pt"
    dcp_to_torch_save(path, out)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = value

    walk("", torch.load(out, weights_only=False))
    return flat
