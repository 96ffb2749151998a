"""The test suite's CPU accelerator, installed into kiln from the outside for one gang job: FSDP's
all-gathers and reduce-scatters (shared_memory_collectives.py) and the tp groups' collectives
(shared_memory_process_group.py) through a shared-memory arena instead of gloo's TCP loopback.
A 4-rank job on 2 cores spends much of its step in loopback (benchmarks/test_suite.md); the
parity the arena's runs show is also shown on stock gloo for every core layout
(tests/distributed/test_gloo_parity.py), the transport kiln's CPU runs take."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from functools import partial, wraps

from tests.support import shared_memory_collectives as collectives
from tests.support import shared_memory_process_group as process_group
from tests.support.patching import patch


@contextlib.contextmanager
def installed(on: bool = True) -> Iterator[None]:
    """kiln's CPU runs take the shared-memory collectives for the duration (`on` False: gloo)."""
    if not (on and process_group.register()):  # not x86-64 Linux: gloo
        yield
        return
    undo = [
        patch("kiln.parallel.mesh", "init_parallel", _tp_groups_in_shared_memory),
        patch("kiln.parallel.apply", "apply_parallelism", _fsdp_in_shared_memory),
    ]
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


def _fsdp_in_shared_memory(apply_parallelism):
    """After kiln's last `fully_shard`, its FSDP units' collectives go through the arena."""

    @wraps(apply_parallelism)
    def accelerated(model, cfg, parallel=None):
        parts = apply_parallelism(model, cfg, parallel)
        if parallel is not None and parallel.device.type == "cpu":
            timeout_s = cfg.resilience.collective_timeout_s
            collectives.use_shared_memory_collectives(parts, timeout_s=timeout_s)
        return parts

    return accelerated


def _tp_groups_in_shared_memory(init_parallel):
    """The tp dimension of kiln's CPU mesh built on the arena's process group."""

    @wraps(init_parallel)
    def accelerated(dist_cfg, device, *, timeout_s: float = 600, **options):
        if device.type != "cpu":
            return init_parallel(dist_cfg, device, timeout_s=timeout_s, **options)
        undo = patch("kiln.parallel.mesh", "init_device_mesh", partial(_tp_override, timeout_s))
        try:
            return init_parallel(dist_cfg, device, timeout_s=timeout_s, **options)
        finally:
            undo()

    return accelerated


def _tp_override(timeout_s: float, init_device_mesh):
    def with_tp_backend(device_type, mesh_shape, *, mesh_dim_names=None, **kwargs):
        names = tuple(mesh_dim_names or ())
        if "tp" in names and mesh_shape[names.index("tp")] > 1:
            timeout = datetime.timedelta(seconds=timeout_s)
            options = process_group.SharedMemoryOptions(_timeout=timeout)
            kwargs["backend_override"] = {"tp": (process_group.BACKEND, options)}
        return init_device_mesh(device_type, mesh_shape, mesh_dim_names=mesh_dim_names, **kwargs)

    return with_tp_backend
