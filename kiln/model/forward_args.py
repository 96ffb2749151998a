"""What a model part is and what its forward is given, stated instead of set on it from outside:
its pipeline stage (built in), and per-call arguments the training step passes (context
parallel's gathers, whether to apply the output head, the normalization of the MoE losses and
of a model's own losses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class StageRole:
    """The part of the model one pipeline stage holds: its blocks, and whether it is the first
    stage (it embeds tokens) and the last (it ends in the final norm and the output head). The
    whole model is the one stage that is both."""

    layers: tuple[int, ...]
    first: bool = True
    last: bool = True

    @classmethod
    def whole(cls, n_layers: int) -> StageRole:
        return cls(tuple(range(n_layers)))


@dataclass(frozen=True)
class LossScale:
    """The factor the training step's backward puts on token-loss sums (1 / the step's valid
    tokens, times FSDP's compensation), for the losses a model adds itself. A dataclass, not a
    tensor: a pipeline schedule splits tensor arguments into micro-batches and hands the rest
    to every micro-batch as it is."""

    per_token: torch.Tensor | float


class SequenceGathers(Protocol):
    """Context parallel's collectives (kiln/parallel/context_parallel.py), as a model uses them:
    the other cp ranks' keys and values, and their positions and document ids for the mask."""

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def gather_sequence(self, values: torch.Tensor) -> torch.Tensor: ...
