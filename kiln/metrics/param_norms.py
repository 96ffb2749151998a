"""Per-parameter gradient norms, the same numbers in every layout: a wrong gradient scale on one
small tensor (a norm weight whose tensor-parallel reduction is missing) hides in the global norm
but not here."""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import nn

from kiln.model.names import canonical_name
from kiln.parallel.grad_norms import squared_grad_norms


def param_grad_norms(
    model_parts: Iterable[nn.Module],
    *,
    pipeline_group: dist.ProcessGroup | None = None,
    duplicates: Iterable[nn.Parameter] = (),
) -> dict[str, float]:
    """{canonical parameter name: L2 norm of its whole gradient}, identical on every rank.

    Sharded gradients are reduced over their mesh (one small collective for all of them); under
    pipeline parallel each stage's names are gathered over `pipeline_group`. `duplicates` (the
    last stage's copy of a tied embedding) are left out, as the global norm leaves them out."""
    skip = {id(p) for p in duplicates}
    named = [
        (canonical_name(name), param.grad)
        for part in model_parts
        for name, param in part.named_parameters()
        if param.grad is not None and id(param) not in skip
    ]
    squares = squared_grad_norms([grad for _, grad in named])
    norms = dict(zip((name for name, _ in named), squares.sqrt().tolist(), strict=True))
    if pipeline_group is not None:
        gathered: list[dict[str, float]] = [{}] * dist.get_world_size(pipeline_group)
        dist.all_gather_object(gathered, norms, group=pipeline_group)
        norms = {name: value for stage in gathered for name, value in stage.items()}
    return dict(sorted(norms.items()))
