"""`kiln train` of one replica group for the fault-tolerance tests. After training, each rank
also writes its shards of the weights and optimizer state (the tensors a live group sends a
rejoining one) to <run_dir>/final_rank_<r>.pt, so a test can compare two groups bitwise.

`--test-gate=PATH` (first argument after `train`, taken out before kiln reads the rest): the
group starts, then waits for PATH to exist before it joins the quorum, so a test can have a
restarted group ready and let it join at once."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import kiln.train.trainer as trainer_module
from kiln.checkpoint.peer_state import local_state
from kiln.config import load_config

GATE = "--test-gate="


def main() -> None:
    assert sys.argv[1] == "train", sys.argv
    args = sys.argv[2:]
    if args[0].startswith(GATE):
        hold_until(Path(args.pop(0)[len(GATE) :]))
    recipe, *overrides = args
    cfg = load_config(recipe, overrides, launched=int(os.environ.get("WORLD_SIZE", "1")))
    trainer = trainer_module.Trainer(cfg)
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    shards = local_state(trainer.model_parts, trainer.optimizers)
    torch.save(shards, Path(trainer.cfg.metrics.run_dir) / f"final_rank_{rank}.pt")


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
