"""Start-up check that a filesystem `checkpoint.dir` is one filesystem for every node.

A path that is local to each node (/tmp, a node-local scratch disk, a relative path under
different working directories) lets every node write its shards to its own disk: each save
"succeeds" and no node holds a checkpoint that can be loaded. The first rank of each node
(LOCAL_RANK 0, as torchrun sets it) writes a token into the folder, and rank 0 must see them all.
"""

from __future__ import annotations

import os
import socket
import uuid

import torch.distributed as dist

from kiln.checkpoint.store import (
    Location,
    ObjectPath,
    missing_folders,
    remove_if_empty,
    store_for,
)
from kiln.errors import ConfigError, KilnError
from kiln.parallel.agree import decide_on_main, gather_from_all, raise_any_failure


def check_one_filesystem(root: Location) -> None:
    """Collective: raise the same ConfigError on every rank if rank 0 cannot see a file that
    another node's rank wrote under `root` (an object store is one store for all: nothing to do)."""
    if isinstance(root, ObjectPath) or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() == 1:
        return
    store, rank = store_for(root), dist.get_rank()
    writes = int(os.environ.get("LOCAL_RANK", rank)) == 0
    check = decide_on_main(lambda: uuid.uuid4().hex[:12], what="name the shared-folder check")
    token = root / f".node_check_{check}_{rank:05d}"
    created = missing_folders(root)
    host, failure = socket.gethostname(), None
    if writes:
        try:
            store.write_own(token, host.encode())
        except OSError as error:
            failure = f"cannot write to checkpoint.dir {root} on {host}: {error}"
    # One gather: every token is written before rank 0 looks, and who wrote one.
    reports = gather_from_all((rank, host, writes, failure))
    if failed := next((f for *_, f in reports if f is not None), None):
        raise KilnError(failed)  # the same message on every rank
    writers = [(r, h) for r, h, wrote, _ in reports if wrote]

    def unseen() -> list[tuple[int, str]]:
        return [
            (r, host)
            for r, host in writers
            if not store.is_file(root / f".node_check_{check}_{r:05d}")
        ]

    missing = decide_on_main(unseen, what="look for every node's file in checkpoint.dir")
    if writes:
        store.remove_file(token)
        remove_if_empty(created)
    raise_any_failure(None)  # every node's clean-up is done before rank 0 writes there again
    if missing:
        named = ", ".join(f"rank {r} on {host}" for r, host in missing[:4])
        raise ConfigError(
            f"checkpoint.dir {root} is not one shared filesystem: rank 0 on "
            f"{socket.gethostname() if rank == 0 else 'its node'} cannot see the files that "
            f"{len(missing)} other node(s) wrote there ({named}). Each node would save its "
            "part of every checkpoint to its own disk, and none could be loaded. Set "
            "checkpoint.dir to an absolute path on a filesystem every node mounts (or an "
            "object store URL such as s3://bucket/run)"
        )
