"""Per-parameter gradient norms, the same numbers in every layout: a wrong gradient scale on one
small tensor (a norm weight whose tensor-parallel reduction is missing) hides in the global norm
but not here."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.model.transformer import canonical_name


def param_grad_norms(
    model_parts: Iterable[nn.Module],
    *,
    pipeline_group: dist.ProcessGroup | None = None,
    duplicates: Iterable[nn.Parameter] = (),
) -> dict[str, float]:
    """{canonical parameter name: L2 norm of its whole gradient}, identical on every rank.

    Sharded gradients are reduced over their mesh (one small collective per parameter); under
    pipeline parallel each stage's names are gathered over `pipeline_group`. `duplicates` (the
    last stage's copy of a tied embedding) are left out, as the global norm leaves them out."""
    skip = {id(p) for p in duplicates}
    norms = {}
    for part in model_parts:
        for name, param in part.named_parameters():
            if param.grad is None or id(param) in skip:
                continue
            norm = torch.linalg.vector_norm(param.grad, dtype=torch.float64)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            norms[canonical_name(name)] = norm.item()
    if pipeline_group is not None:
        gathered: list[dict[str, float]] = [{}] * dist.get_world_size(pipeline_group)
        dist.all_gather_object(gathered, norms, group=pipeline_group)
        norms = {name: value for stage in gathered for name, value in stage.items()}
    return dict(sorted(norms.items()))
