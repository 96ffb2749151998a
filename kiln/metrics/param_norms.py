"""Per-parameter gradient norms, the same numbers in every layout: a wrong gradient scale on one
small tensor (a norm weight whose tensor-parallel reduction is missing) hides in the global norm
but not here. Taken at every step (before clipping changes the gradients), on the device; read
back only when the step is logged."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from kiln.model.names import canonical_name
from kiln.parallel.grad_norms import squared_grad_norms


class ParamGradNorms:
    """The norms of one step, on the device until `read`."""

    def __init__(
        self, names: list[str], squares: torch.Tensor, pipeline_group: dist.ProcessGroup | None
    ):
        self.names, self.squares, self.pipeline_group = names, squares, pipeline_group

    def read(self) -> dict[str, float]:
        """{canonical parameter name: L2 norm of its whole gradient}, identical on every rank;
        under pipeline parallel every rank of the pipeline calls it at once."""
        norms = dict(zip(self.names, self.squares.sqrt().tolist(), strict=True))
        if self.pipeline_group is not None:
            gathered: list[dict[str, float]] = [{}] * dist.get_world_size(self.pipeline_group)
            dist.all_gather_object(gathered, norms, group=self.pipeline_group)
            norms = {name: value for stage in gathered for name, value in stage.items()}
        return dict(sorted(norms.items()))


def param_grad_norms(
    model_parts: Iterable[nn.Module],
    *,
    pipeline_group: dist.ProcessGroup | None = None,
    duplicates: Iterable[nn.Parameter] = (),
) -> ParamGradNorms:
    """Every parameter's gradient norm, read by `ParamGradNorms.read`.

    Sharded gradients are reduced over their mesh (one small collective for all of them); under
    pipeline parallel each stage's names are gathered over `pipeline_group` when read.
    `duplicates` (the last stage's copy of a tied embedding) are left out, as the global norm
    leaves them out."""
    skip = {id(p) for p in duplicates}
    named = [
        (canonical_name(name), param.grad)
        for part in model_parts
        for name, param in part.named_parameters()
        if param.grad is not None and id(param) not in skip
    ]
    squares = squared_grad_norms([grad for _, grad in named])
    return ParamGradNorms([name for name, _ in named], squares, pipeline_group)
