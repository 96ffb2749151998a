"""Tensor parallel (Megatron-style) with sequence parallel and loss parallel, on DTensor.

The model family's plan (`ParallelPlan.tp`, `.block_tp`) names the style of each module; for Llama,
q/k/v and w1/w3 are split by output columns (heads, hidden units) and wo/w2 by input rows, so
each block needs one all-gather in and one reduce-scatter out per sub-layer. Between sub-layers
the residual stream stays split along the sequence (sequence parallel): norms and residual adds
run on 1/tp of the tokens, and the norm weights' gradients are summed over tp by DTensor. The
embedding is split by vocabulary rows and the output head by vocabulary columns; logits stay
vocabulary-sharded into the cross entropy (loss parallel).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from kiln.model.parallel_plan import ParallelPlan, blocks_of
from kiln.parallel.float8 import float8_tensor_parallel


def apply_tensor_parallel(
    model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh, *, float8: bool = False
) -> None:
    """Split `model`'s modules over `mesh` as the plan says; `float8`: the model's float8 layers
    (tensorwise) take torchao's float8 styles, which gather their inputs in float8."""
    # A pipeline stage holds only some top-level modules; its hidden states cross stages
    # sequence-sharded.
    present = {name: style for name, style in plan.tp.items() if getattr(model, name) is not None}
    if present:
        parallelize_module(
            model, mesh, float8_tensor_parallel(model, present) if float8 else present
        )
    for block in (b.module for b in blocks_of(model, plan)):
        styles = plan.block_tp(block)
        if float8:
            styles = float8_tensor_parallel(block, styles)
        parallelize_module(block, mesh, styles)
