"""AdamW that updates each rank's local shard of a DTensor weight.

torch.optim.AdamW given FSDP/TP DTensors sends each of its foreach ops through DTensor's
dispatch, which unwraps, checks placements and rewraps every tensor of the list: per-tensor
overhead that costs more than the arithmetic on small models (benchmarks/optimizers.md). AdamW is
elementwise, so updating each rank's local shard is updating the whole tensor, in any layout (as
Lion and Schedule-Free AdamW do, kiln/train/elementwise.py). This class runs torch's own
functional AdamW, the same foreach (CPU) or fused (CUDA) kernels with the same arguments, on the
local shards: bit for bit torch.optim.AdamW's update.

The state is torch.optim.AdamW's, made by its own `_init_group`: `step` (a scalar tensor),
`exp_avg` and `exp_avg_sq` (DTensors laid out like the weight, or plain tensors for plain
weights), so distributed checkpoints save and reshard it as before and a checkpoint of either
optimizer loads into the other. `_init_group` is private: torch is pinned (pyproject.toml) and
tests/unit/test_adamw.py checks this class against torch.optim.AdamW step for step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim.adam import adam

from kiln.train.elementwise import local, local_grad


class ShardLocalAdamW(torch.optim.AdamW):
    """torch.optim.AdamW with kiln's settings only (lr, betas, eps, weight_decay); `fused` picks
    the fused kernels (all weights on CUDA), otherwise foreach, which torch would not pick by
    itself on CPU (it falls back to one tensor at a time there)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        fused: bool = False,
    ):
        super().__init__(
            params,
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            # The flags torch.optim.AdamW(fused=True) / (foreach=True) store in the groups, so
            # that state dicts match theirs key for key.
            fused=True if fused else None,
            foreach=None if fused else True,
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            max_exp_avg_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            # torch's bookkeeping, unchanged: skips weights without a gradient, creates the state
            # on first use (moments as zeros_like(weight): DTensors for DTensor weights). Its list
            # of gradients ([]) is not used: local_grad below.
            has_complex = self._init_group(
                group, params, [], exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
            )
            beta1, beta2 = group["betas"]
            adam(
                [local(p) for p in params],
                # A gradient in another placement than its weight's is brought to it first.
                [local_grad(p) for p in params],
                [local(t) for t in exp_avgs],
                [local(t) for t in exp_avg_sqs],
                [local(t) for t in max_exp_avg_sqs],
                steps,  # plain scalar tensors, one per weight: nothing to unwrap
                # The group's flags as torch.optim.AdamW.step passes them (torch's defaults, as
                # this class sets only lr, betas, eps and weight_decay).
                foreach=group["foreach"],
                capturable=group["capturable"],
                differentiable=group["differentiable"],
                fused=group["fused"],
                grad_scale=None,  # kiln does not scale losses (no fp16 GradScaler)
                found_inf=None,
                has_complex=has_complex,
                decoupled_weight_decay=True,
                amsgrad=group["amsgrad"],
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )
        return loss
