"""What a model part is and what its forward is given, stated instead of set on it from outside:
its pipeline stage (built in), and per-call arguments the training step passes (context
parallel's gathers, whether to apply the output head, the normalization of the MoE losses and
of a model's own losses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kiln.model.document_mask import LayerMask


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
    attention over the whole sequences from this rank's part of them, and the positions and
    document ids of the queries and keys for the mask."""

    # How many blocks the keys are attended in: 1 (the whole sequences at once) or one per cp
    # rank (ring attention), each with its own mask.
    key_blocks: int
    # The cp group's size and this rank's place in it: rank r holds chunks r and 2·size−1−r of
    # 2·size equal chunks of every sequence, in that order.
    size: int
    rank: int

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: LayerMask,
        *,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def gather_sequence(self, values: torch.Tensor) -> torch.Tensor: ...

    def query_sequence(self, values: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor: ...

    def gather_summaries(self, x: torch.Tensor) -> torch.Tensor: ...
