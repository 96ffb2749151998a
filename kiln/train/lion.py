"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

Each step moves every weight by ±lr: the sign of an interpolation between the momentum and the
gradient, then the momentum tracks the gradient at a slower rate:

    update = sign(β1·m + (1 − β1)·g)
    p ← p·(1 − lr·wd) − lr·update
    m ← β2·m + (1 − β2)·g

Every operation is elementwise, so each rank updates its local shard of a DTensor weight (FSDP,
TP, EP) and the result is the same in every layout, bit for bit. One momentum buffer per weight:
half of AdamW's state.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kiln.train.elementwise import local, local_grad


class Lion(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ):
        if lr < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Lion: bad lr {lr}, betas {betas} or weight_decay {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
            weights = [local(p) for p in params]
            grads = [local_grad(p) for p in params]
            momenta = [local(self.state[p]["exp_avg"]) for p in params]
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            update = torch._foreach_mul(momenta, beta1)
            torch._foreach_add_(update, grads, alpha=1 - beta1)
            torch._foreach_sign_(update)
            if wd != 0:
                torch._foreach_mul_(weights, 1 - lr * wd)
            torch._foreach_add_(weights, update, alpha=-lr)
            torch._foreach_mul_(momenta, beta2)
            torch._foreach_add_(momenta, grads, alpha=1 - beta2)
        return loss
