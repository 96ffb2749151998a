"""Tiled init: any block of a tensor is drawn alone and equals that block of the whole tensor."""

import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from kiln.config import ModelConfig
from kiln.model import build_model, materialize
from kiln.model import init as tiled

TINY = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_hidden_dim=96)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 4 × 8 so that small tensors span many tiles and shards cut through them."""
    monkeypatch.setattr(tiled, "TILE_ROWS", 4)
    monkeypatch.setattr(tiled, "TILE_COLS", 8)


def draw(shape, offset=None, size=None, *, seed=0, name="w", std=1.0):
    offset = offset or (0,) * len(shape)
    out = torch.empty(size or shape)
    tiled.fill_normal_region(out, tuple(shape), tuple(offset), std=std, seed=seed, name=name)
    return out


@pytest.mark.parametrize("shape", [(37,), (19, 37), (3, 10, 21)])
def test_any_block_equals_that_block_of_the_whole(small_tiles, shape):
    whole = draw(shape)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        lo = [int(torch.randint(0, n, (1,), generator=generator)) for n in shape]
        hi = [
            int(torch.randint(a, n + 1, (1,), generator=generator))
            for a, n in zip(lo, shape, strict=True)
        ]
        size = tuple(b - a for a, b in zip(lo, hi, strict=True))
        block = draw(shape, tuple(lo), size)
        assert torch.equal(block, whole[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))]), (
            lo,
            hi,
        )


def test_row_and_column_slices_concatenate_to_the_whole(small_tiles):
    whole = draw((23, 45))
    rows = [draw((23, 45), (a, 0), (b - a, 45)) for a, b in [(0, 5), (5, 6), (6, 17), (17, 23)]]
    cols = [draw((23, 45), (0, a), (23, b - a)) for a, b in [(0, 9), (9, 30), (30, 45)]]
    assert torch.equal(torch.cat(rows), whole)
    assert torch.equal(torch.cat(cols, dim=1), whole)


def test_statistics_and_keys():
    # Real tile sizes: 2 × 3 tiles of 128 × 1024.
    a = draw((256, 3000), std=0.02)
    assert abs(a.mean().item()) < 1e-3
    assert abs(a.std().item() - 0.02) < 2e-4
    assert torch.equal(a, draw((256, 3000), std=0.02))
    assert not torch.equal(a, draw((256, 3000), std=0.02, seed=1))
    assert not torch.equal(a, draw((256, 3000), std=0.02, name="v"))
    # Each tile has its own stream: no two tiles repeat each other's numbers.
    assert not torch.equal(a[:128, :1024], a[128:, :1024])
    assert not torch.equal(a[:128, :1024], a[:128, 1024:2048])


def shard_by_dtensor_rules(full, mesh_shape, coordinate, placements):
    """The local tensor DTensor cuts from `full`: placements applied left to right, each split by
    DTensor's own `_split_tensor` (the reference for `shard_regions`)."""
    local = full
    for placement, ranks, rank in zip(placements, mesh_shape, coordinate, strict=True):
        if isinstance(placement, (Shard, _StridedShard)):
            local = placement._split_tensor(local, ranks, with_padding=False)[0][rank]
    return local


LAYOUTS = [
    ((97, 6), (4,), [Shard(0)]),  # uneven FSDP: 25, 25, 25, 22 rows
    ((5, 6), (8,), [Shard(0)]),  # more ranks than rows: the last three get nothing
    ((6, 90), (4,), [Shard(1)]),  # row-parallel TP
    ((94, 6), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP2 over TP colwise
    ((39, 30), (2, 2), [Shard(0), Shard(1)]),  # FSDP2 over TP rowwise, uneven
    ((60, 8), (4, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    ((20, 6), (8, 4), [_StridedShard(0, split_factor=4), Shard(0)]),  # ragged and empty shards
    ((30, 6), (2, 2, 2), [Replicate(), _StridedShard(0, split_factor=2), Shard(0)]),  # HSDP × TP
    ((12, 6), (2, 3), [Shard(0), _StridedShard(0, split_factor=2)]),  # gaps: several blocks
]


@pytest.mark.parametrize(("shape", "mesh_shape", "placements"), LAYOUTS)
def test_shard_regions_follow_dtensor(small_tiles, shape, mesh_shape, placements):
    full = torch.arange(shape[0] * shape[1]).view(shape)
    whole = draw(shape)
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        expected = shard_by_dtensor_rules(full, mesh_shape, coordinate, placements)
        regions = tiled.shard_regions(shape, mesh_shape, list(coordinate), tuple(placements))
        got = torch.full(expected.shape, -1)
        for local, offset, size in regions:
            got[local] = full[tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))]
        assert torch.equal(got, expected), coordinate
        # And the init of this rank's shard alone is that shard of the whole init.
        mine = torch.empty(expected.shape)
        tiled.fill_normal_local(mine, shape, regions, std=1.0, seed=0, name="w")
        assert torch.equal(mine, shard_by_dtensor_rules(whole, mesh_shape, coordinate, placements))


def test_partial_placements_are_refused():
    from torch.distributed.tensor import Partial

    with pytest.raises(NotImplementedError):
        tiled.shard_regions((4, 4), (2,), [0], (Partial(),))


def test_materialize_without_seed_builds_buffers_and_draws_nothing(monkeypatch):
    def no_draws(*args, **kwargs):
        raise AssertionError("seed=None must not draw weights")

    monkeypatch.setattr(tiled, "fill_normal_", no_draws)
    model = materialize(build_model(TINY), device="cpu", seed=None)
    reference = build_model(TINY, device="cpu")
    assert torch.equal(model.rope_cos, reference.rope_cos)
    assert torch.equal(model.rope_sin, reference.rope_sin)
