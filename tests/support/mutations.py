"""Mutations: each breaks one rule of kiln's on purpose, so that a test can show the parity
checks catch it. Installed from the outside, by patching kiln's functions for one job: the gang
workers install a job's mutation by name (tests/distributed/workers.py); a process started by
torchrun or `kiln verify` installs the one named by KILN_TEST_MUTATION at start-up
(site/sitecustomize.py, with `subprocess_env`).

An installed mutation prints a warning on every rank the first time it changes what kiln does,
naming what it breaks: a run that carries one says so in its own output."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from functools import partial, wraps
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from tests.support.patching import patch

ENV = "KILN_TEST_MUTATION"
SITE = Path(__file__).parent / "site"
REPO = Path(__file__).resolve().parents[2]

DESCRIPTIONS = {
    "fsdp_before_tp": "FSDP is applied before tensor parallel (the wrong order)",
    "average_gradients": "gradients are averaged over data-parallel ranks, not summed",
    "pp_scale_grads": (
        "the pipeline schedule divides the already normalized gradients by the micro-batch count"
    ),
    "unreduced_sp_norm_grads": (
        "sequence-parallel norm weights keep each tp rank's partial gradient (no sum over tp)"
    ),
    "moe_grads_not_summed_over_tp": (
        "the MoE units tensor parallel leaves whole are sharded over the data ranks only: their "
        "gradients are not summed over the tp ranks, which route other tokens"
    ),
}


def warning(name: str) -> str:
    return f"tests: WARNING: mutation {name} is installed: {DESCRIPTIONS[name]}"


@contextlib.contextmanager
def installed(name: str | None) -> Iterator[None]:
    """Mutation `name` (None: none) patched into kiln for the duration."""
    if name is None:
        yield
        return
    undo = install(name)
    try:
        yield
    finally:
        undo()


def install(name: str) -> Callable[[], None]:
    """Patch mutation `name` into kiln; return the undo."""
    if name not in DESCRIPTIONS:
        raise KeyError(f"unknown mutation {name}; known: {', '.join(DESCRIPTIONS)}")
    warn = _Warning(name)
    return INSTALLERS[name](warn)


def install_from_env() -> None:
    """The mutation KILN_TEST_MUTATION names, for the life of this process (sitecustomize)."""
    if name := os.environ.get(ENV):
        install(name)


def subprocess_env(name: str) -> dict[str, str]:
    """Environment entries under which a Python process (and those it starts: torchrun's ranks)
    runs with mutation `name` installed."""
    path = os.pathsep.join(filter(None, [str(SITE), str(REPO), os.environ.get("PYTHONPATH")]))
    return {ENV: name, "PYTHONPATH": path}


class _Warning:
    """Prints the mutation's warning once per installation, when it first takes effect."""

    def __init__(self, name: str) -> None:
        self.name, self.printed = name, False

    def __call__(self) -> None:
        if not self.printed:
            self.printed = True
            print(warning(self.name), file=sys.stderr, flush=True)


def _fsdp_before_tp(warn: _Warning) -> Callable[[], None]:
    """Each part is sharded over the data ranks before tensor parallel splits it (kiln's own
    sharding, in its place after the other steps, is never reached: the layout fails first)."""

    def make(apply_parallelism):
        @wraps(apply_parallelism)
        def wrong_order(model, cfg, parallel=None):
            fsdp_mesh = parallel.fsdp_mesh() if parallel is not None else None
            if fsdp_mesh is None:
                return apply_parallelism(model, cfg, parallel)
            shard_first = partial(_shard_then_split, warn, cfg, fsdp_mesh)
            undo = patch("kiln.parallel.apply", "apply_tensor_parallel", shard_first)
            try:
                return apply_parallelism(model, cfg, parallel)
            finally:
                undo()

        return wrong_order

    return patch("kiln.parallel.apply", "apply_parallelism", make)


def _shard_then_split(warn, cfg, fsdp_mesh, apply_tensor_parallel):
    from kiln.parallel.fsdp import apply_fsdp
    from kiln.parallel.mixed_precision import fsdp_policy

    def split(part, plan, mesh, **kwargs):
        warn()
        apply_fsdp(part, plan, fsdp_mesh, policy=fsdp_policy(cfg))
        return apply_tensor_parallel(part, plan, mesh, **kwargs)

    return split


def _average_gradients(warn: _Warning) -> Callable[[], None]:
    """The loss is not scaled by the FSDP rank count, so FSDP's average stays an average."""

    def make(_compensation):
        def no_compensation(mesh):
            if mesh is not None:
                warn()
            return 1

        return no_compensation

    return patch("kiln.parallel.fsdp", "gradient_average_compensation", make)


def _pp_scale_grads(warn: _Warning) -> Callable[[], None]:
    """The schedule divides the gradients by the micro-batch count, on top of the loss's own
    normalization (torch's schedules read `scale_grads` at every step)."""

    def make(build_schedule):
        @wraps(build_schedule)
        def scaling(*args, **kwargs):
            warn()
            schedule = build_schedule(*args, **kwargs)
            schedule.scale_grads = True
            return schedule

        return scaling

    return patch("kiln.parallel.pipeline", "build_schedule", make)


def _unreduced_sp_norm_grads(warn: _Warning) -> Callable[[], None]:
    """Every sequence-parallel norm of a block plan computes on its local tokens as if they
    were all of them, so its weight gradient is each tp rank's partial sum, never summed over tp
    (the weights drift apart). Activations and their gradients stay right, so the loss and the
    global gradient norm barely move at the first step."""

    def make(apply_tensor_parallel):
        @wraps(apply_tensor_parallel)
        def unreduced(model, plan, mesh, **kwargs):
            warn()
            block_tp = plan.block_tp
            plan = dataclasses.replace(plan, block_tp=lambda b: unreduced_norms(block_tp(b)))
            return apply_tensor_parallel(model, plan, mesh, **kwargs)

        return unreduced

    return patch("kiln.parallel.tensor_parallel", "apply_tensor_parallel", make)


def _moe_grads_not_summed_over_tp(warn: _Warning) -> Callable[[], None]:
    """No sequence mesh: the MoE units go on the data ranks' mesh like the rest."""

    def make(_sequence_mesh):
        def data_ranks_only(parallel):
            warn()
            return None

        return data_ranks_only

    return patch("kiln.parallel.apply", "_sequence_mesh", make)


INSTALLERS = {
    "fsdp_before_tp": _fsdp_before_tp,
    "average_gradients": _average_gradients,
    "pp_scale_grads": _pp_scale_grads,
    "unreduced_sp_norm_grads": _unreduced_sp_norm_grads,
    "moe_grads_not_summed_over_tp": _moe_grads_not_summed_over_tp,
}


def unreduced_norms(styles: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
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
