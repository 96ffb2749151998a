"""Weight init that costs each rank O(its shard), not O(the model).

The full tensor is a fixed grid of tiles and tile k is drawn from its own generator, seeded by
(seed, parameter name, k). The grid depends only on the full shape, never on the layout, so a rank
draws just the tiles its shard overlaps and copies the overlap: the full weights are bitwise the
same under FSDP, TP, both, pipeline stages or one process, and no rank draws the whole model.
"""

from __future__ import annotations

import hashlib
import itertools
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from kiln.config.sections import ModelConfig
from kiln.model.names import canonical_name

# Tiles are TILE_ROWS × TILE_COLS over a tensor's last two dims (1-D tensors: chunks of as many
# elements). At 128K elements a tile takes ~2 ms to draw on a CPU core, so its own cost (a sha256,
# a generator, a copy out of the tile) stays small; and the tiles are small enough for the blocks
# real layouts cut: FSDP and column-parallel row blocks are mostly multiples of 128 rows, and
# row-parallel column blocks multiples of 1024. A rank of llama3_70b at tp=4 × dp_shard=8 draws
# 6% more numbers than its shard holds (benchmarks/startup_init.md).
TILE_ROWS = 128
TILE_COLS = 1024

# A block of the full tensor held locally: where it sits in the local tensor, its global offset,
# and its shape.
Region = tuple[tuple[slice, ...], tuple[int, ...], tuple[int, ...]]


@torch.no_grad()
def fill_normal_(param: torch.Tensor, *, std: float, seed: int, name: str) -> None:
    """Fill `param` (a plain tensor or this rank's DTensor shard) with its part of the full tiled
    normal(0, std) tensor of (seed, name)."""
    if isinstance(param, DTensor):
        coordinate = param.device_mesh.get_coordinate()
        if coordinate is None:  # this rank holds no part of the tensor
            return
        regions = shard_regions(
            tuple(param.shape), tuple(param.device_mesh.shape), coordinate, param.placements
        )
        fill_normal_local(
            param.to_local(), tuple(param.shape), regions, std=std, seed=seed, name=name
        )
    else:
        whole = tuple(slice(None) for _ in param.shape)
        region = (whole, (0,) * param.ndim, tuple(param.shape))
        fill_normal_local(param, tuple(param.shape), [region], std=std, seed=seed, name=name)


def fill_normal_local(
    local: torch.Tensor,
    full_shape: tuple[int, ...],
    regions: list[Region],
    *,
    std: float,
    seed: int,
    name: str,
) -> None:
    """Fill the local tensor region by region. Each block is drawn in fp32 on the CPU, as the
    generators are CPU generators, then copied once to the local tensor's device and dtype."""
    for local_slices, offset, shape in regions:
        block = torch.empty(shape, dtype=torch.float32)
        fill_normal_region(block, full_shape, offset, std=std, seed=seed, name=name)
        local[local_slices].copy_(block)


def fill_normal_region(
    out: torch.Tensor,
    full_shape: tuple[int, ...],
    offset: tuple[int, ...],
    *,
    std: float,
    seed: int,
    name: str,
) -> None:
    """Fill `out` (fp32, CPU) with the block at `offset` of the full tiled tensor of `full_shape`,
    drawing only the tiles the block overlaps."""
    tile = tile_shape(len(full_shape))
    spans = [
        range(o // t, (o + n - 1) // t + 1) for o, n, t in zip(offset, out.shape, tile, strict=True)
    ]
    for index in itertools.product(*spans):
        start = [i * t for i, t in zip(index, tile, strict=True)]
        size = [min(t, full - s) for t, full, s in zip(tile, full_shape, start, strict=True)]
        generator = torch.Generator().manual_seed(tile_seed(seed, name, index))
        # Always draw into a fresh contiguous tile: normal_ on a strided view may order its draws
        # differently, and the values must depend on the tile alone.
        drawn = torch.empty(size, dtype=torch.float32).normal_(0.0, std, generator=generator)
        lo = [max(o, s) for o, s in zip(offset, start, strict=True)]
        hi = [min(o + n, s + k) for o, n, s, k in zip(offset, out.shape, start, size, strict=True)]
        into = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset, strict=True))
        take = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start, strict=True))
        out[into].copy_(drawn[take])


def tile_shape(ndim: int) -> tuple[int, ...]:
    """The tile of an `ndim`-D tensor: rows × cols over the last two dims, one along the others."""
    if ndim == 0:
        return ()
    if ndim == 1:
        return (TILE_ROWS * TILE_COLS,)
    return (1,) * (ndim - 2) + (TILE_ROWS, TILE_COLS)


def tile_seed(seed: int, name: str, index: tuple[int, ...]) -> int:
    """A 63-bit seed for tile `index` of parameter `name`, stable across processes and runs."""
    key = ":".join(str(part) for part in (seed, name, *index))
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def shard_regions(
    full_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: list[int],
    placements: tuple[Placement, ...],
) -> list[Region]:
    """The blocks of the full tensor that the rank at `coordinate` holds under `placements`.

    Works from plain data (no process group), so a benchmark can ask about any rank of any
    layout. Follows DTensor's rules: Shard splits like `torch.chunk` (the last ranks get less or
    nothing); _StridedShard, which FSDP2 puts on the data-parallel dim of a tensor TP already split
    along the same dim, chunks into `split_factor` pieces, chunks each piece again, and keeps this
    rank's chunk of every piece. The result is one block for Shard and FSDP2 + TP, several only
    if a placement leaves gaps.
    """
    indices = [torch.arange(n) for n in full_shape]
    for placement, ranks, rank in zip(placements, mesh_shape, coordinate, strict=True):
        if isinstance(placement, _StridedShard):
            pieces = torch.chunk(indices[placement.dim], placement.split_factor)
            indices[placement.dim] = torch.cat([_chunk(piece, ranks, rank) for piece in pieces])
        elif isinstance(placement, Shard):
            indices[placement.dim] = _chunk(indices[placement.dim], ranks, rank)
        elif not isinstance(placement, Replicate):
            # Partial (a sum of per-rank tensors) has no part of the full tensor to fill.
            raise NotImplementedError(f"cannot initialize a parameter placed as {placement}")
    runs = [_runs(dim_indices) for dim_indices in indices]
    regions = []
    for combination in itertools.product(*runs):
        local = tuple(slice(start, start + n) for start, _, n in combination)
        offset = tuple(first for _, first, _ in combination)
        shape = tuple(n for _, _, n in combination)
        regions.append((local, offset, shape))
    return regions


def _chunk(indices: torch.Tensor, ranks: int, rank: int) -> torch.Tensor:
    """`rank`'s part of `torch.chunk(indices, ranks)`, which may make fewer chunks than ranks."""
    chunks = torch.chunk(indices, ranks) if len(indices) else ()
    return chunks[rank] if rank < len(chunks) else indices[:0]


def _runs(indices: torch.Tensor) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each stretch of consecutive global indices."""
    if len(indices) == 0:
        return []
    breaks = (torch.nonzero(indices.diff() != 1).flatten() + 1).tolist()
    starts, ends = [0, *breaks], [*breaks, len(indices)]
    return [(s, int(indices[s]), e - s) for s, e in zip(starts, ends, strict=True)]


@torch.no_grad()
def init_decoder_weights(model: nn.Module, cfg: ModelConfig, *, seed: int) -> None:
    """Norms to 1, biases to 0, every other weight normal with `init_std`, in tiles (see the
    module doc)."""
    for wrapped_name, param in model.named_parameters():
        name = canonical_name(wrapped_name)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif _is_bias(name):
            param.zero_()
        else:
            fill_normal_(param, std=init_std(cfg, name), seed=seed, name=name)


def _is_bias(name: str) -> bool:
    """Linear layers' biases and the experts' (b1, b2, b3): zero at init, as transformers does."""
    return name.endswith(".bias") or name.endswith(("experts.b1", "experts.b2", "experts.b3"))


def init_std(cfg: ModelConfig, name: str) -> float:
    """Standard deviation of the normal init of parameter `name` (canonical, without wrappers)."""
    if name == "tok_embeddings.weight" and not cfg.tie_embeddings:
        # Unit-scale embeddings put the residual stream at O(1) from the start; at init_std,
        # every Adam step would move them by a large fraction of their size.
        return 1.0
    if name.endswith(
        (
            "attention.wo.weight",
            "feed_forward.w2.weight",
            "feed_forward.shared_experts.w2.weight",
            "feed_forward.experts.w2",
        )
    ):
        # Outputs written into the residual stream shrink with depth, so it does not grow.
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std
