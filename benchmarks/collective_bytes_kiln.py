"""`kiln train` of one replica group for benchmarks/diloco_cost.py's (e): counts the bytes of
every cross-group collective, per call and per step, and writes them to
<run_dir>/collective_bytes_rank_<r>.json at the end (the group's run dir).

Every tensor kiln sends across the groups goes through torchft's `Manager.allreduce`
(kiln/parallel/replica_groups.py): `ReplicaGroups.sum` (the per-step sums: the valid-token count
before the forward, the loss and the stop flags after the backward; also `sum_gradients`'
buckets where FSDP2's hook does not serve), the hook's `sum_shard` (each FSDP unit's gradient
shard in the backward) and `start_sum` (DiLoCo's pseudo-gradients, with one value more: the
group's weight in the mean). The wrapper adds up `numel() * element_size()` of each call's
buffer, under the kind its caller says; a caller it does not know is kept under its own name, so
a collective that bypassed these would show. That is the buffer: a ring all-reduce sends about
2(n-1)/n times it per rank. The quorum, the commit vote (torchft's gRPC to the lighthouse and
the group's manager) and a heal's HTTP transfer are not collectives and are not counted.

    python -m benchmarks.collective_bytes_kiln train RECIPE [OVERRIDES]
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torchft

import kiln.train.trainer as trainer_module
from benchmarks.replica_sum_kiln import train

# Manager.allreduce's caller (its qualified name) -> what the buffer holds.
KINDS = {
    "ReplicaGroups.sum_in_backward.<locals>.sum_shard": "gradients",
    "ReplicaGroups.start_sum": "pseudo_gradients",
    "ReplicaGroups.sum": "per_step_sums",
}


class Counts:
    """Bytes and calls per kind: of the current trainer step, of every finished one, and of
    what ran outside a step; and how many calls had each buffer size."""

    def __init__(self):
        self.steps: list[dict] = []
        self.current: dict | None = None
        self.outside = {"bytes": Counter(), "calls": Counter()}
        self.sizes: dict[str, Counter] = defaultdict(Counter)

    def add(self, kind: str, nbytes: int) -> None:
        where = self.current if self.current is not None else self.outside
        where["bytes"][kind] += nbytes
        where["calls"][kind] += 1
        self.sizes[kind][nbytes] += 1


def main() -> None:
    assert sys.argv[1] == "train", sys.argv
    counts = counted(Counts())
    run_dir = train(sys.argv[2:])
    rank = int(os.environ.get("RANK", "0"))
    out = {"steps": counts.steps, "outside": counts.outside, "sizes": counts.sizes}
    (run_dir / f"collective_bytes_rank_{rank}.json").write_text(json.dumps(out))


def counted(counts: Counts) -> Counts:
    """Count each cross-group all-reduce's buffer, per trainer step (its quorum, its step and,
    under DiLoCo, the sync after it)."""
    allreduce, train_step = torchft.Manager.allreduce, trainer_module.Trainer.train_step

    def managed_allreduce(self, tensor, *args, **kwargs):
        if self.errored() is None:  # after an error torchft sends nothing
            counts.add(_kind(sys._getframe(1)), tensor.numel() * tensor.element_size())
        return allreduce(self, tensor, *args, **kwargs)

    def step(self, *args, **kwargs):
        counts.current = {"step": self.step + 1, "bytes": Counter(), "calls": Counter()}
        result = train_step(self, *args, **kwargs)
        counts.current["committed"] = result.committed
        counts.steps.append(counts.current)
        counts.current = None
        return result

    torchft.Manager.allreduce = managed_allreduce
    trainer_module.Trainer.train_step = step
    return counts


def _kind(caller) -> str:
    name = caller.f_code.co_qualname
    if name == "ReplicaGroups.sum" and caller.f_back.f_code.co_qualname.endswith("sum_gradients"):
        return "gradients"  # a bucket of gradient shards (and, in the last, the loss and flags)
    return KINDS.get(name, f"other: {name}")


def read(run_dir: Path) -> list[dict]:
    """The counts of every rank of a group's run dir, in rank order."""
    paths = sorted(
        run_dir.glob("collective_bytes_rank_*.json"), key=lambda p: int(p.stem.rsplit("_", 1)[1])
    )
    return [json.loads(p.read_text()) for p in paths]


if __name__ == "__main__":
    main()
