"""Test-only switches (mutations): each breaks one rule on purpose, so that the parity tests can
show they catch it. Never set them in a real run.

No production module changes its math silently: a switch that is set prints a warning on every
rank, each time a run reads it (once or twice per run), naming what it breaks.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

MUTATIONS = {
    "KILN_TEST_FSDP_BEFORE_TP": "FSDP is applied before tensor parallel (the wrong order)",
    "KILN_TEST_AVERAGE_GRADIENTS": "gradients are averaged over data-parallel ranks, not summed",
    "KILN_TEST_PP_SCALE_GRADS": (
        "the pipeline schedule divides the already normalized gradients by the micro-batch count"
    ),
    "KILN_TEST_UNREDUCED_SP_NORM_GRADS": (
        "sequence-parallel norm weights keep each tp rank's partial gradient (no sum over tp)"
    ),
    "KILN_TEST_MOE_GRADS_NOT_SUMMED_OVER_TP": (
        "the MoE units tensor parallel leaves whole are sharded over the data ranks only: their "
        "gradients are not summed over the tp ranks, which route other tokens"
    ),
    "KILN_TEST_DELAY_COMMIT": (
        "rank 0 commits each checkpoint 3 s late and the other ranks wait until their part of a "
        "background save is written"
    ),
}


def mutation_on(name: str) -> bool:
    """Whether the test-only switch `name` is set to "1"; if so, warn. Not once per process: a
    test worker process runs many jobs, and each job must show the warning in its own output."""
    if name not in MUTATIONS:
        raise KeyError(f"unknown test switch {name}; known: {', '.join(MUTATIONS)}")
    on = os.environ.get(name) == "1"
    if on:
        print(
            f"kiln: WARNING: test switch {name} is set: {MUTATIONS[name]}",
            file=sys.stderr,
            flush=True,
        )
    return on


def unreduced_norm_gradients(styles: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """KILN_TEST_UNREDUCED_SP_NORM_GRADS: every sequence-parallel norm of a block plan computes on
    its local tokens as if they were all of them, so its weight gradient is each tp rank's partial
    sum, never summed over tp (the weights drift apart). Activations and their gradients stay
    right, so the loss and the global gradient norm barely move at the first step."""
    return {
        path: _UnreducedGradients(style) if isinstance(style, SequenceParallel) else style
        for path, style in styles.items()
    }


class _UnreducedGradients(SequenceParallel):
    # The input shard is declared replicated instead of sharded: DTensor then sees nothing to sum.
    def __init__(self, style: SequenceParallel):
        super().__init__(use_local_output=style.use_local_output)
        self.sequence_sharding = style.sequence_sharding

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._replicate_module_fn,
            _declare_replicated,
            partial(_declare_sharded, self.sequence_sharding, self.use_local_output),
        )


def _declare_replicated(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    local = inputs[0].to_local() if isinstance(inputs[0], DTensor) else inputs[0]
    return (DTensor.from_local(local, mesh, (Replicate(),), run_check=False), *inputs[1:])


def _declare_sharded(
    sharding: tuple, use_local_output: bool, module: nn.Module, output: DTensor, mesh: DeviceMesh
) -> torch.Tensor:
    local = output.to_local()
    return local if use_local_output else DTensor.from_local(local, mesh, sharding, run_check=False)
