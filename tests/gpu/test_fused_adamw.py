"""kiln's shard-local AdamW (kiln/train/adamw.py) with fused=True, the kernel kiln builds on CUDA,
bit for bit against torch.optim.AdamW(fused=True): the same functional call with the same
arguments, so the same kernel on the same inputs in the same order. Exact comparison."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.config.sections import ModelConfig, OptimizerConfig
from kiln.model import build_model, materialize
from kiln.train.adamw import ShardLocalAdamW
from kiln.train.optimizer import _decay_groups, _trainable, build_optimizer

CFG = OptimizerConfig(lr=3e-3, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8)
MODEL = ModelConfig(
    dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=4096, ffn_hidden_dim=384
)
STEPS = 6


def model_on(device: torch.device) -> nn.Module:
    """A small kiln model on `device`, the same weights every call."""
    return materialize(build_model(MODEL), device=device, seed=0)


def fused_torch_adamw(groups: list[dict]) -> torch.optim.AdamW:
    """torch.optim.AdamW(fused=True), or a skip where this device has no fused kernel."""
    try:
        return torch.optim.AdamW(groups, lr=CFG.lr, betas=tuple(CFG.betas), eps=CFG.eps, fused=True)
    except RuntimeError as error:
        pytest.skip(f"torch has no fused AdamW here: {error}")


def train(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """STEPS optimizer steps as kiln's loop takes them, on gradients from a seeded generator."""
    # Each group's lr set every step; the norm gains get no gradient at the first two steps
    # (torch then skips them: no state, no decay).
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = CFG.lr * (step + 1) / STEPS
        generator = torch.Generator().manual_seed(100 + step)
        for name, param in model.named_parameters():
            grad = torch.randn(param.shape, generator=generator) * 1e-2
            skipped = step < 2 and name.endswith("norm.weight")
            param.grad = None if skipped else grad.to(device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_shard_local_fused_adamw_equals_torch_fused_bit_for_bit(device: torch.device) -> None:
    ours, theirs = model_on(device), model_on(device)
    torch_opt = fused_torch_adamw(_decay_groups(_trainable(theirs), CFG.weight_decay))
    local_opt = ShardLocalAdamW(
        _decay_groups(_trainable(ours), CFG.weight_decay),
        lr=CFG.lr,
        betas=tuple(CFG.betas),
        eps=CFG.eps,
        weight_decay=CFG.weight_decay,
        fused=True,
    )
    train(ours, local_opt, device)
    train(theirs, torch_opt, device)
    assert not torch.equal(ours.output.weight, model_on(device).output.weight)  # it moved
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        # Exact: the same fused kernel, the same inputs, the same order.
        assert torch.equal(a, b), name
        a_state, b_state = local_opt.state[a], torch_opt.state[b]
        assert a_state.keys() == b_state.keys(), name
        for key in a_state:
            assert torch.equal(a_state[key], b_state[key]), (name, key)
    assert local_opt.state_dict()["param_groups"] == torch_opt.state_dict()["param_groups"]


def test_kiln_builds_the_fused_kernel_on_cuda_only(device: torch.device) -> None:
    (optimizer,) = build_optimizer(model_on(device), CFG)
    assert isinstance(optimizer, ShardLocalAdamW)
    for group in optimizer.param_groups:
        # The fused kernel where every weight is on CUDA, foreach elsewhere (the dry run's CPU).
        assert group["fused"] is (True if device.type == "cuda" else None)
        assert group["foreach"] is (None if device.type == "cuda" else True)
