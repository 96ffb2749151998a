"""`kiln train` of one replica group for the fault-tolerance tests. After training, each rank
also writes its shards of the weights and optimizer state (the tensors a live group sends a
rejoining one) to <run_dir>/final_rank_<r>.pt, so a test can compare two groups bitwise.

`--test-gate=PATH` (first argument after `train`, taken out before kiln reads the rest): the
group starts, then waits for PATH to exist before it joins the quorum, so a test can have a
restarted group ready and let it join at once. `--test-order` (there too): each rank writes
<run_dir>/order_rank_<r>.json, the order of the first step's backward of each FSDP unit, its
cross-group all-reduces and its commit."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torchft
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

import kiln.train.trainer as trainer_module
from kiln.checkpoint.peer_state import local_state
from kiln.config import load_config

GATE = "--test-gate="
ORDER = "--test-order"


def main() -> None:
    assert sys.argv[1] == "train", sys.argv
    args = sys.argv[2:]
    if args[0].startswith(GATE):
        hold_until(Path(args.pop(0)[len(GATE) :]))
    order = record_order() if args[0] == ORDER and args.pop(0) else None
    recipe, *overrides = args
    cfg = load_config(recipe, overrides, launched=int(os.environ.get("WORLD_SIZE", "1")))
    trainer = trainer_module.Trainer(cfg)
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    if order is not None:
        (Path(trainer.cfg.metrics.run_dir) / f"order_rank_{rank}.json").write_text(
            json.dumps(order)
        )
    shards = local_state(trainer.model_parts, trainer.optimizers)
    torch.save(shards, Path(trainer.cfg.metrics.run_dir) / f"final_rank_{rank}.pt")


def record_order() -> list[str]:
    """Until the first commit: "backward" as an FSDP unit's backward ends (before it
    reduce-scatters), "all_reduce" as a cross-group all-reduce starts, then "commit"."""
    order: list[str] = []

    def recording(cls, name: str, what: str) -> None:
        original = getattr(cls, name)

        def recorded(*args, **kwargs):
            if "commit" not in order:
                order.append(what)
            return original(*args, **kwargs)

        setattr(cls, name, recorded)

    recording(FSDPParamGroup, "post_backward", "backward")
    recording(torchft.Manager, "allreduce", "all_reduce")
    recording(torchft.Manager, "should_commit", "commit")
    return order


def hold_until(gate: Path) -> None:
    """Joining the replica groups waits until `gate` exists."""
    join = trainer_module.join_replica_groups

    def gated(*args, **kwargs):
        while not gate.exists():
            time.sleep(0.02)
        return join(*args, **kwargs)

    trainer_module.join_replica_groups = gated


if __name__ == "__main__":
    main()
