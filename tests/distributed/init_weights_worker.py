"""A gang job (workers.py): build the debug model in a layout, gather its initial full weights on
rank 0 and save them."""

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from kiln.config import load_config
from kiln.model import build_model, materialize
from kiln.parallel.apply import apply_parallelism
from kiln.parallel.mesh import init_parallel


def gather_initial_weights(config: str, out: str, *overrides: str) -> None:
    cfg = load_config(config, list(overrides))
    parallel = init_parallel(cfg.distributed, torch.device("cpu"))
    full = {}
    # Under pipeline parallel each rank holds some stages; their full weights are merged below.
    for part in apply_parallelism(build_model(cfg.model), cfg, parallel):
        materialize(part, device="cpu", seed=cfg.train.seed)
        # Without cpu_offload every rank keeps the full tensors, not rank 0 only: the pipeline
        # stages' ranks each send theirs.
        options = StateDictOptions(full_state_dict=True)
        full.update(get_model_state_dict(part, options=options))
    gathered = [None] * dist.get_world_size() if parallel.is_main else None
    dist.gather_object(full, gathered)
    if parallel.is_main:
        torch.save({name: t for stage in gathered for name, t in stage.items()}, out)
    dist.destroy_process_group()
