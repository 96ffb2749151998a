"""Cross-rank agreement: every decision that depends on the filesystem, a clock or a background
thread is taken on rank 0 and sent to the others, so no two ranks can act differently on the same
step and wait for each other in a collective until the timeout.

One process (no process group) takes every decision itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from kiln.errors import KilnError, RelayedError

T = TypeVar("T")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_main() -> bool:
    return not _distributed() or dist.get_rank() == 0


def decide_on_main(decide: Callable[[], T], *, what: str) -> T:
    """Run `decide` on rank 0 and return its result on every rank. If it raises, rank 0 raises
    its own error and every other rank a KilnError with rank 0's message, instead of waiting for
    a result that never comes. `what` completes "rank 0 could not ..."."""
    result, failure = None, None
    if is_main():
        try:
            result = decide()
        except Exception as error:
            failure = error
    if _distributed():
        message = [result, str(failure) if failure is not None else None]
        dist.broadcast_object_list(message, src=0)
        result, remote_failure = message
        if remote_failure is not None and failure is None:
            raise RelayedError(f"rank 0 could not {what}: {remote_failure}")
    if failure is not None:
        raise failure
    return result


def gather_from_all(value: T) -> list[T]:
    """Every rank's `value`, in rank order, on every rank ([value] in one process)."""
    if not _distributed():
        return [value]
    gathered: list[T] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, value)
    return gathered


def raise_any_failure(failure: str | None) -> None:
    """Each rank's own failure message (or None) in; every rank raises the first rank's failure,
    so an error on one rank (a full disk) stops all of them with the same message."""
    if _distributed():
        failures: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
        failure = next((f for f in failures if f is not None), None)
    if failure is not None:
        raise KilnError(failure)


def any_rank(flags: dict[str, bool | torch.Tensor], *, device: torch.device) -> dict[str, bool]:
    """For each flag, whether it is set on any rank: one small all-reduce for all of them. A
    tensor flag (a finiteness test on the device) is read only after the reduction, so the host
    waits for the device once per call."""
    values = torch.stack(
        [torch.as_tensor(value, device=device).float().reshape(()) for value in flags.values()]
    )
    if _distributed():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(flags, (bool(v) for v in values.tolist()), strict=True))
