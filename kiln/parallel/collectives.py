"""Small collectives the training step needs, and telling a failed collective from other errors."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from kiln.errors import KilnError, first_line


def sum_over(value: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`value` summed over `group` (None: this rank alone), leaving the input untouched."""
    if group is None:
        return value
    value = value.clone()
    dist.all_reduce(value, group=group)
    return value


def is_collective_failure(error: BaseException) -> bool:
    """A collective that failed because a peer died, hung or closed its connection.

    Recognised by type where torch gives one: `torch.distributed.DistError` and its subclasses,
    which NCCL errors and timeouts (DistBackendError), a lost connection to the store
    (DistNetworkError: the rank hosting it died) and a store or rendezvous timeout
    (DistStoreError: a rank never arrived) raise. gloo, the CPU backend, raises a bare
    RuntimeError in torch 2.13 when a peer never joins a collective ("Timed out waiting Nms for
    recv operation to complete") or dies ("Connection closed by peer"), in all_reduce,
    broadcast, barrier, monitored_barrier and async work alike (measured with a 2-process group
    on loopback: tests/unit/test_collective_failure.py). Such an error is told apart only by
    the source location gloo's transport puts in its message, `[.../gloo/transport/tcp/pair.cc:553]`.
    """
    if isinstance(error, dist.DistError):
        return True
    return type(error) is RuntimeError and _GLOO_TRANSPORT.search(str(error)) is not None


def collective_failure(error: BaseException, rank: int, step: int, newest: object) -> KilnError:
    """The message of a rank whose collective failed in `step` (`newest`: the checkpoint a
    restarted job resumes from, None for scratch)."""
    return KilnError(
        f"rank {rank}: a collective failed during step {step}: {first_line(error)}. Another "
        f"rank most likely died or hung (its log names why); the job resumes from "
        f"{newest or 'scratch'} when restarted"
    )


# gloo's transport layer (tcp, or uv on macOS and Windows) throws with its file and line first.
_GLOO_TRANSPORT = re.compile(r"\[[^\]\n]*gloo[/\\]transport[/\\]\w+[/\\]\w+\.cc:\d+\]")
