"""Schedule-Free AdamW (Defazio et al. 2024, "The Road Less Scheduled", Algorithm 1).

No decaying learning-rate schedule: an online average of the iterates does its work. Three
sequences: z, the AdamW-like base sequence; x, the weighted average of the z's, which is the
model to evaluate and to keep; y, the point between them where gradients are taken:

    y_t     = (1 − β1)·z_t + β1·x_t
    v_t     = β2·v_{t−1} + (1 − β2)·g_t²                       (g_t: the gradient at y_t)
    γ_t     = lr_t·√(1 − β2^t)                                  (lr_t: warmed up by the scheduler)
    z_{t+1} = z_t − γ_t·g_t / (√v_t + ε) − γ_t·λ·y_t
    c_{t+1} = γ_t² / Σ_{i≤t} γ_i²
    x_{t+1} = (1 − c_{t+1})·x_t + c_{t+1}·z_{t+1}

The weights hold y while training; the state holds z and v (as much as AdamW's two moments).
x is not stored: `eval_mode()` turns the weights into x = (y − (1 − β1)·z) / β1 and
`train_mode()` back into y = (1 − β1)·z + β1·x. Evaluation and checkpoints see x (the trainer
switches around both, see `optimizer_eval_point`); a checkpoint therefore holds x, and a resumed
run switches to y before its first step. A switch back computes y from x and z as a resumed run
does, so a run that saves at step k and one resumed from that save continue bitwise alike.

The per-parameter state keeps the step count, Σγ² and the mode as plain Python numbers, saved
with the checkpoint: tensors there would be cast to the weights' dtype and device when loaded.
Every operation is elementwise on each rank's local shard, so the update is the same in every
layout.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator

import torch

from kiln.train.elementwise import local, local_grad


class ScheduleFreeAdamW(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        # β1 = 0 would make y = z and leave x unrecoverable from the two.
        if not (0 < betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(
                f"ScheduleFreeAdamW needs 0 < betas[0] < 1, 0 <= betas[1] < 1: {betas}"
            )
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # Parameters at the same step and Σγ² (normally all of the group) update together.
            runs: dict[tuple[int, float], list[torch.Tensor]] = {}
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state.update(
                        z=param.detach().clone(),
                        exp_avg_sq=torch.zeros_like(param),
                        step=0,
                        lr_sq_sum=0.0,
                        eval_mode=False,
                    )
                if state["eval_mode"]:
                    raise RuntimeError(
                        "ScheduleFreeAdamW.step() with the weights at the evaluation point: "
                        "call train_mode() first (the gradient must be taken at y)"
                    )
                runs.setdefault((state["step"], state["lr_sq_sum"]), []).append(param)
            for (step, lr_sq_sum), params in runs.items():
                self._update(params, group, step + 1, lr_sq_sum)
        return loss

    def _update(self, params: list[torch.Tensor], group: dict, t: int, lr_sq_sum: float) -> None:
        beta1, beta2 = group["betas"]
        gamma = group["lr"] * math.sqrt(1 - beta2**t)
        lr_sq_sum += gamma**2
        c = gamma**2 / lr_sq_sum if lr_sq_sum > 0 else 0.0
        ys = [local(p) for p in params]
        zs = [local(self.state[p]["z"]) for p in params]
        vs = [local(self.state[p]["exp_avg_sq"]) for p in params]
        grads = [local_grad(p) for p in params]
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
        denominators = torch._foreach_sqrt(vs)
        torch._foreach_add_(denominators, group["eps"])
        # d = g/(√v + ε) + λ·y_t: z_{t+1} = z_t − γ·d.
        direction = torch._foreach_div(grads, denominators)
        del denominators
        if group["weight_decay"] != 0:
            torch._foreach_add_(direction, ys, alpha=group["weight_decay"])
        # y_{t+1} = (1 − β1)·z_{t+1} + β1·x_{t+1} with x_t = (y_t − (1 − β1)·z_t)/β1 expands to
        # (1 − c)·y_t + c·z_t − γ·(1 − β1·(1 − c))·d: y moves before z does.
        torch._foreach_lerp_(ys, zs, c)
        torch._foreach_add_(ys, direction, alpha=gamma * (beta1 * (1 - c) - 1))
        torch._foreach_add_(zs, direction, alpha=-gamma)
        for p in params:
            self.state[p].update(step=t, lr_sq_sum=lr_sq_sum)

    @property
    def evaluating(self) -> bool:
        """Whether the weights are at the evaluation point x."""
        return any(state.get("eval_mode", False) for state in self.state.values())

    @torch.no_grad()
    def eval_mode(self) -> bool:
        """Turn the weights into the evaluation point x; return whether any weight changed."""
        return self._switch(to_eval=True)

    @torch.no_grad()
    def train_mode(self) -> bool:
        """Turn the weights back into y, where gradients are taken; return whether any changed."""
        return self._switch(to_eval=False)

    def _switch(self, *, to_eval: bool) -> bool:
        switched = False
        for group in self.param_groups:
            # Weights that never stepped have x = y = z: nothing to switch, no state to start.
            states = [self.state.get(p) for p in group["params"]]
            params = [p for p, s in zip(group["params"], states, strict=True) if s]
            params = [p for p in params if self.state[p]["eval_mode"] != to_eval]
            if not params:
                continue
            beta1 = group["betas"][0]
            # x = y + (1 − 1/β1)·(z − y);  y = x + (1 − β1)·(z − x).
            weight = 1 - 1 / beta1 if to_eval else 1 - beta1
            torch._foreach_lerp_(
                [local(p) for p in params], [local(self.state[p]["z"]) for p in params], weight
            )
            for p in params:
                self.state[p]["eval_mode"] = to_eval
            switched = True
        return switched


@contextlib.contextmanager
def optimizer_eval_point(optimizers) -> Iterator[None]:
    """Within: every Schedule-Free optimizer among `optimizers` (nested lists of optimizers, as
    the trainer keeps them per model part) has its weights at the evaluation point; after, those
    it switched are back at the training point. Other optimizers are left alone."""
    switched = [o for o in _schedule_free(optimizers) if o.eval_mode()]
    try:
        yield
    finally:
        for optimizer in switched:
            optimizer.train_mode()


def optimizer_train_point(optimizers) -> None:
    """Weights loaded from a checkpoint are the evaluation point: back to the training point."""
    for optimizer in _schedule_free(optimizers):
        optimizer.train_mode()


def _schedule_free(optimizers) -> list[ScheduleFreeAdamW]:
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    found = []
    for item in optimizers or ():
        if isinstance(item, ScheduleFreeAdamW):
            found.append(item)
        elif not isinstance(item, torch.optim.Optimizer):
            found += _schedule_free(item)
    return found
