"""Experts that receive no token for many optimizer steps in a row.

Such an expert gets zero gradients, so only weight decay moves it: it is dead weight that
balancing has not revived. A warning names it once, when its idle stretch reaches the patience
(`metrics.idle_expert_warn_steps`), and again only after it received tokens and went idle anew.
The stretches are counted on the device at every step and read back only when a logged step
asks for the warnings: reading them every step would make the host wait for the device.
"""

from __future__ import annotations

import torch


class IdleExperts:
    def __init__(self, layer_names: list[str], *, patience: int):
        self.layer_names, self.patience = layer_names, patience
        self.idle_steps: torch.Tensor | None = None  # (layers, experts) steps in a row
        # (layers, experts): a stretch reached the patience since the warnings were last read.
        self.reached: torch.Tensor | None = None

    def update(self, loads: torch.Tensor) -> None:
        """`loads` (layers, experts): the step's assignments, summed over every rank holding the
        step's tokens (the same on each). Counts on the device; nothing is read back."""
        if self.patience <= 0:
            return
        previous = self.idle_steps if self.idle_steps is not None else torch.zeros_like(loads)
        self.idle_steps = torch.where(loads == 0, previous + 1, torch.zeros_like(loads))
        reached = self.idle_steps == self.patience
        self.reached = reached if self.reached is None else self.reached | reached

    def messages(self) -> list[str]:
        """A message per expert whose idle stretch reached the patience since the last call (one
        read of the device)."""
        if self.reached is None:
            return []
        reached, self.reached = self.reached.nonzero().tolist(), None
        return [
            f"expert {expert} of {self.layer_names[layer]} has received no token for "
            f"{self.patience} steps in a row: it only decays. Raise model.moe.bias_update_rate "
            "or model.moe.aux_loss_weight to rebalance (see docs/moe.md, 'Reading expert load')"
            for layer, expert in reached
        ]
