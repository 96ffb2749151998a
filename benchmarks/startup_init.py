"""Start-up: the time and host memory one rank spends initializing its shard of llama3_70b.

Meta-free and process-group-free: the layout's shard of every weight is computed here from the
tensor-parallel plan (tp=4) and FSDP2's placements over it (dp_shard=8), for one rank of the
32-rank job, and only that rank's work runs.

    new (tiled):  allocate the local shard, draw only the tiles it overlaps (`kiln/model/init.py`)
    old (full):   draw the full tensor from one generator keyed by (seed, name), keep the slice

The old path draws the full 70B parameters on every rank; it runs here on the embedding, one
block and the output head, and its time is extrapolated to the whole model by parameter count.
Norm weights are `fill_(1.0)` either way and are left out. Each path runs in its own process so
its peak RSS is its own.

    OMP_NUM_THREADS=1 python benchmarks/startup_init.py [--recipe configs/train/70b_32gpu_tp4.toml]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import resource
import subprocess
import sys
import time

import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from kiln.config import ModelConfig, load_config
from kiln.model import build_model
from kiln.model import init as tiled
from kiln.model.names import canonical_name

# kiln/parallel/tensor_parallel.py: column-parallel weights and the vocabulary-split embedding are
# Shard(0) on tp, row-parallel weights Shard(1). FSDP2 then shards dim 0 of each tp shard over
# dp_shard, which on the 2-D mesh (dp_shard, tp) reads _StridedShard(0, split_factor=tp) when tp
# split dim 0 too (the placements tests/distributed/test_init.py runs through).
ROW_PARALLEL = ("attention.wo.weight", "feed_forward.w2.weight")
SUBSET = ("tok_embeddings.", "layers.0.", "output.")


def placements_for(name: str, tp: int) -> tuple:
    if name.endswith(ROW_PARALLEL):
        return (Shard(0), Shard(1))
    return (_StridedShard(0, split_factor=tp), Shard(0))


def weights(recipe: str) -> tuple[ModelConfig, list[tuple[str, tuple[int, ...]]], tuple[int, int]]:
    """The model config, (name, full shape) of every normal-initialized weight, and (dp_shard, tp)."""
    cfg = load_config(recipe)
    tp = cfg.distributed.tp
    mesh_shape = (32 // tp, tp)
    model = build_model(cfg.model)
    named = [(canonical_name(n), tuple(p.shape)) for n, p in model.named_parameters()]
    return cfg.model, [(n, s) for n, s in named if not n.endswith("norm.weight")], mesh_shape


def drawn_elements(shape: tuple[int, ...], regions: list) -> int:
    """Elements of the tiles the regions overlap: the numbers this rank draws for the tensor."""
    tile = tiled.tile_shape(len(shape))
    total = 0
    for _, offset, size in regions:
        spans = [
            range(o // t, (o + n - 1) // t + 1) for o, n, t in zip(offset, size, tile, strict=True)
        ]
        for index in itertools.product(*spans):
            total += math.prod(
                min(t, full - i * t) for i, t, full in zip(index, tile, shape, strict=True)
            )
    return total


def worst_rank(named, mesh_shape) -> tuple[tuple[int, int], dict[tuple[int, int], int]]:
    """The coordinate that draws the most numbers (tiles cut by a shard edge are drawn whole)."""
    drawn = {}
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        drawn[coordinate] = sum(
            drawn_elements(
                shape,
                tiled.shard_regions(
                    shape, mesh_shape, list(coordinate), placements_for(name, mesh_shape[1])
                ),
            )
            for name, shape in named
        )
    return max(drawn, key=drawn.get), drawn


def run_new(recipe: str, coordinate: tuple[int, int]) -> dict:
    cfg, named, mesh_shape = weights(recipe)
    shard_elements, biggest = 0, 0
    start = time.perf_counter()
    for name, shape in named:
        regions = tiled.shard_regions(
            shape, mesh_shape, list(coordinate), placements_for(name, mesh_shape[1])
        )
        local_shape = [0] * len(shape)
        for local, _, _ in regions:
            local_shape = [max(a, s.stop) for a, s in zip(local_shape, local, strict=True)]
        local = torch.empty(local_shape)
        std = tiled.init_std(cfg, name)
        tiled.fill_normal_local(local, shape, regions, std=std, seed=0, name=name)
        shard_elements += local.numel()
        biggest = max(biggest, local.numel() * 4)
        del local
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "shard_elements": shard_elements, "largest_tensor_bytes": biggest}


def run_old(recipe: str, coordinate: tuple[int, int]) -> dict:
    """Today's init on the subset: a full draw per tensor, then this rank's slice of it."""
    cfg, named, mesh_shape = weights(recipe)
    subset = [(n, s) for n, s in named if n.startswith(SUBSET)]
    drawn, biggest = 0, 0
    start = time.perf_counter()
    for name, shape in subset:
        seed = tiled.tile_seed(0, name, ())
        generator = torch.Generator().manual_seed(seed)
        full = torch.empty(shape).normal_(0.0, tiled.init_std(cfg, name), generator=generator)
        regions = tiled.shard_regions(
            shape, mesh_shape, list(coordinate), placements_for(name, mesh_shape[1])
        )
        for _, offset, size in regions:
            full[tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))].clone()
        drawn += full.numel()
        biggest = max(biggest, full.numel() * 4)
        del full
    seconds = time.perf_counter() - start
    total = sum(math.prod(s) for _, s in named)
    return {
        "subset_seconds": seconds,
        "subset_elements": drawn,
        "total_elements": total,
        "seconds": seconds * total / drawn,
        "largest_tensor_bytes": biggest,
    }


def child(path: str, recipe: str, coordinate: tuple[int, int]) -> None:
    result = (run_new if path == "new" else run_old)(recipe, coordinate)
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(result))


def spawn(path: str, recipe: str, coordinate: tuple[int, int]) -> dict:
    command = [sys.executable, __file__, "--child", path, "--recipe", recipe]
    command += ["--coordinate", *map(str, coordinate)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="configs/train/70b_32gpu_tp4.toml")
    parser.add_argument("--child", choices=("new", "old"), help=argparse.SUPPRESS)
    parser.add_argument("--coordinate", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.recipe, tuple(args.coordinate))
        return
    _, named, mesh_shape = weights(args.recipe)
    coordinate, drawn = worst_rank(named, mesh_shape)
    new = spawn("new", args.recipe, coordinate)
    old = spawn("old", args.recipe, coordinate)
    gb = 1e9
    print(f"date {datetime.date.today()}  torch {torch.__version__}")
    print(
        f"threads {torch.get_num_threads()}  recipe {args.recipe}  mesh (dp_shard, tp) {mesh_shape}"
    )
    print(f"rank drawing most: (dp_shard, tp) = {coordinate}")
    print(
        f"per-rank numbers drawn, tiled: min {min(drawn.values()) / gb:.3f}e9, "
        f"max {max(drawn.values()) / gb:.3f}e9; shard {new['shard_elements'] / gb:.3f}e9; "
        f"full model {old['total_elements'] / gb:.2f}e9"
    )
    print(
        f"old subset: {old['subset_elements'] / gb:.3f}e9 numbers in {old['subset_seconds']:.1f} s"
    )
    print("| path | seconds per rank | peak RSS (GB) | largest tensor (GB) |")
    print("|---|---:|---:|---:|")
    for label, r in (
        ("old: full draw, slice (extrapolated)", old),
        ("new: tiled, shard only", new),
    ):
        print(
            f"| {label} | {r['seconds']:.1f} | {r['peak_rss_bytes'] / gb:.2f} | "
            f"{r['largest_tensor_bytes'] / gb:.2f} |"
        )
    print(f"speed-up: {old['seconds'] / new['seconds']:.1f}x")


if __name__ == "__main__":
    main()
