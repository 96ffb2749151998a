"""Run under torchrun: build the debug model in a layout, gather its initial full weights, save them."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from kiln.config import load_config
from kiln.model import build_model, materialize
from kiln.parallel.apply import apply_parallelism
from kiln.parallel.mesh import init_parallel


def main(config: str, out: str, *overrides: str) -> None:
    cfg = load_config(config, list(overrides))
    parallel = init_parallel(cfg.distributed, torch.device("cpu"))
    model = build_model(cfg.model)
    apply_parallelism(model, cfg, parallel)
    materialize(model, device="cpu", seed=cfg.train.seed)
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if parallel.is_main:
        torch.save(full, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
