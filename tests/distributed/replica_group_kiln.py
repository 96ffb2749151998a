"""`kiln train` of one replica group for the fault-tolerance tests. After training, each rank
also writes its shards of the weights and optimizer state (the tensors a live group sends a
rejoining one) to <run_dir>/final_rank_<r>.pt, so a test can compare two groups bitwise.

`--test-gate=PATH` (first argument after `train`, taken out before kiln reads the rest): the
group starts, then waits for PATH to exist before it joins the quorum, so a test can have a
restarted group ready and let it join at once. `--test-stall-backward=N:PATH` (next): in the
backward of the process's N-th step, after the first FSDP unit's gradients crossed the groups,
each rank writes PATH.rank_<r> and waits to be killed. `--test-order` (last): each rank writes
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
STALL = "--test-stall-backward="
ORDER = "--test-order"


def main() -> None:
    assert sys.argv[1] == "train", sys.argv
    args = sys.argv[2:]
    if args[0].startswith(GATE):
        hold_until(Path(args.pop(0)[len(GATE) :]))
    if args[0].startswith(STALL):
        call, marker = args.pop(0)[len(STALL) :].split(":", 1)
        stall_backward(int(call), Path(marker))
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


def stall_backward(call: int, marker: Path) -> None:
    """In the backward of this process's `call`-th training step, as the second FSDP unit's
    backward ends (the first unit's gradients have crossed the groups): mark, then hang."""
    steps, units = [0], [0]
    train_step, post_backward = trainer_module.Trainer.train_step, FSDPParamGroup.post_backward

    def counting(self, **kwargs):
        steps[0] += 1
        return train_step(self, **kwargs)

    def stalling(self, *args, **kwargs):
        if steps[0] == call:
            units[0] += 1
            if units[0] == 2:
                Path(f"{marker}.rank_{os.environ['RANK']}").touch()
                while True:
                    time.sleep(1)
        return post_backward(self, *args, **kwargs)

    trainer_module.Trainer.train_step = counting
    FSDPParamGroup.post_backward = stalling


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
