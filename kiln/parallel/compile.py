"""Per-block torch.compile (docs/architecture.md, "The apply order"). The loss is compiled on
its own, outside the model (kiln/train/loss.py); the embedding, final norm and head between them
stay eager (one op or one GEMM each: benchmarks/overhead.md, "Compile scope").

Each block is compiled on its own, after tensor/context parallel and activation checkpointing
have wrapped it and before FSDP shards it, so every block of a kind shares one compiled graph
and FSDP's gathers stay outside it. Under tensor parallel the modules around the blocks (the
vocabulary-split embedding) hand the residual stream on as the `AsyncCollectiveTensor` of their
asynchronous reduce-scatter. A compiled graph that takes one as input returns its gradient as a
plain tensor where DTensor's backward expects a DTensor, and the backward fails with
"'Tensor' object has no attribute '_local_tensor'" (torch 2.11-2.13; async collective tensors at
graph boundaries: https://github.com/pytorch/pytorch/issues/180614), so their outputs are
waited for before they reach a compiled block.

Blocks that communicate (tensor or context parallel) name their process groups inside the compiled
graph, while AOTAutograd's on-disk cache keys a DTensor graph by the mesh's shape, not by this rank's
groups: with several tp (or cp) groups on one machine, a rank loads a graph another rank compiled
and fails with "Could not resolve the process group registered under the name N" (reproduced: the
second run of dp_shard=2 × tp=2 on one machine's warm cache;
https://github.com/pytorch/pytorch/issues/188390, fixed only for ranks on distinct GPUs). Those
runs skip that cache; Inductor's own cache, whose key holds the group names, still serves them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from kiln.model.parallel_plan import ParallelPlan, blocks_of


def compile_blocks(model: nn.Module, plan: ParallelPlan, *, communicating: bool) -> None:
    """Compile each of `model`'s blocks, and make the modules that feed them hand on plain tensors;
    `communicating`: the blocks hold tensor- or context-parallel collectives."""
    if communicating:
        torch._functorch.config.enable_autograd_cache = False
    main = getattr(model, plan.blocks)
    for child in model.children():
        if child is not main:
            child.register_forward_hook(_settle_async_output)
    for block in blocks_of(model, plan):
        block.module.compile()


def _settle_async_output(module: nn.Module, inputs: object, output: object) -> object:
    # Any op other than a view waits for the collective and returns a plain tensor that keeps its
    # place in the autograd graph (`AsyncCollectiveTensor.wait()` would drop it); the copy is of
    # one sequence-sharded activation, once a step.
    if isinstance(output, AsyncCollectiveTensor):
        return torch.clone(output)
    return output
